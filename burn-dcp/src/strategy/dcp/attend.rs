//! The compute instructions of a DCP program: one query block of a head unit against the key
//! blocks the plan gives it, forward (its partial output merged by LSE) and backward (its
//! partial gradients accumulated).

use super::*;

impl<B: FlashOps> Run<'_, B> {
    /// The kernel problem of query block `q` against key blocks `kv` of its sequence.
    pub(super) fn problem(&self, q: BlockId, kv: &[usize]) -> VarlenAttention {
        let segment = |block: BlockId| {
            let tokens = self.schedule.block_tokens(block);
            Segment::contiguous(block.seq, tokens.start, tokens.len())
        };
        let kv_segments = kv
            .iter()
            .map(|&block| segment(BlockId { seq: q.seq, block }))
            .collect();
        VarlenAttention {
            seq_lens: self.schedule.seq_lens.clone(),
            masks: self.batch.masks.clone(),
            q_segments: vec![segment(q)],
            kv_segments,
            scale: self.batch.scale,
        }
    }

    /// The concatenated keys and values of blocks `kv` of sequence `seq`, head unit `unit`.
    pub(super) fn keys_of(
        &self,
        seq: usize,
        unit: usize,
        kv: &[usize],
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), CpError> {
        let mut ks = Vec::with_capacity(kv.len());
        let mut vs = Vec::with_capacity(kv.len());
        for &block in kv {
            let key = (BlockId { seq, block }, unit);
            let (k, v) = self.block_keys(key)?;
            ks.push(k);
            vs.push(v);
        }
        Ok((cat_tokens(ks, 0), cat_tokens(vs, 0)))
    }

    pub(super) fn attend_forward(&mut self, key: Key, kv: &[usize]) -> Result<(), CpError> {
        let (q, unit) = key;
        let query = self
            .held(&self.blocks.queries, "the queries", key)?
            .q
            .clone();
        let (k, v) = self.keys_of(q.seq, unit, kv)?;
        let partial = B::flash_forward(query, k, v, &self.problem(q, kv))?;
        self.merge_output(key, partial)
    }

    /// Merges a partial output into the unit's, kept in the accumulator dtype (f32 for half
    /// inputs: one rounding, when the result is sent or returned).
    pub(super) fn merge_output(
        &mut self,
        key: Key,
        partial: FlashOutput<B>,
    ) -> Result<(), CpError> {
        let partial = FlashOutput {
            out: widened(partial.out),
            lse: partial.lse,
        };
        let merged = match self.blocks.outputs.remove(&key) {
            Some(previous) => B::flash_merge(previous, partial)?,
            None => partial,
        };
        self.blocks.outputs.insert(key, merged);
        Ok(())
    }

    pub(super) fn attend_backward(&mut self, key: Key, kv: &[usize]) -> Result<(), CpError> {
        let (q, unit) = key;
        let query = self.held(&self.blocks.queries, "the queries", key)?.clone();
        let (out, lse, dout) = query.grads.ok_or_else(|| self.missing("the output", key))?;
        let (k, v) = self.keys_of(q.seq, unit, kv)?;
        let inputs = BackwardInputs {
            q: query.q,
            k,
            v,
            out,
            lse,
            dout,
        };
        let grads = B::flash_backward(inputs, &self.problem(q, kv))?;
        add_into(&mut self.blocks.dq, key, grads.dq);
        let sizes: Vec<usize> = kv
            .iter()
            .map(|&block| self.tokens(BlockId { seq: q.seq, block }))
            .collect();
        let dks = split_sizes(grads.dk, 0, &sizes);
        let dvs = split_sizes(grads.dv, 0, &sizes);
        for ((&block, dk), dv) in kv.iter().zip(dks).zip(dvs) {
            let key = (BlockId { seq: q.seq, block }, unit);
            add_pair_into(&mut self.blocks.dkv, key, dk, dv);
        }
        Ok(())
    }
}

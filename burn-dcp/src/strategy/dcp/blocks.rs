//! The blocks a DCP rank holds and moves: the copies it sends and receives (shapes checked),
//! the partial results it merges and sends home, a head unit handed to another rank, and the
//! home's outputs and gradients at the end of a pass.

use super::*;

impl<B: FlashOps> Run<'_, B> {
    pub(super) fn tokens(&self, block: BlockId) -> usize {
        self.schedule.block_tokens(block).len()
    }

    /// The shapes of a block's copy (`result`: false) or result (true) on `side`: what a
    /// receive of it expects.
    pub(super) fn shapes(
        &self,
        side: Side,
        block: BlockId,
        backward: bool,
        result: bool,
    ) -> Vec<Vec<usize>> {
        let t = self.tokens(block);
        let (h, kv, d) = self.heads.unit_dims();
        match (side, backward, result) {
            // A forward's copy: Q; a backward's result: dQ.
            (Side::QueryOutput, false, false) | (Side::QueryOutput, true, true) => {
                vec![vec![t, h, d]]
            }
            // A backward's copy: Q, out, LSE and dO.
            (Side::QueryOutput, true, false) => {
                vec![vec![t, h, d], vec![t, h, d], vec![h, t], vec![t, h, d]]
            }
            // A forward's result: out and LSE.
            (Side::QueryOutput, false, true) => vec![vec![t, h, d], vec![h, t]],
            // K and V, or dK and dV.
            (Side::KeyValue, ..) => vec![vec![t, kv, d]; 2],
        }
    }

    /// The keys and values of `key` this rank holds.
    pub(super) fn block_keys(&self, key: Key) -> Result<(Tensor<B, 3>, Tensor<B, 3>), CpError> {
        self.held(&self.blocks.keys, "the keys", key).cloned()
    }

    /// The entry of `key` in one of this rank's block maps, or the error naming `what` is missing.
    pub(super) fn held<'m, T>(
        &self,
        map: &'m HashMap<Key, T>,
        what: &str,
        key: Key,
    ) -> Result<&'m T, CpError> {
        map.get(&key).ok_or_else(|| self.missing(what, key))
    }

    pub(super) fn missing(&self, what: &str, (block, unit): Key) -> CpError {
        CpError::Config(format!(
            "DCP rank {}: the program uses {what} of block {} of sequence {} (head unit {unit}), which it does not hold (an inconsistent plan)",
            self.comm.rank(),
            block.block,
            block.seq
        ))
    }

    pub(super) fn copy_of(
        &self,
        side: Side,
        key: Key,
        backward: bool,
    ) -> Result<Vec<Payload>, CpError> {
        match side {
            Side::QueryOutput => {
                let query = self.held(&self.blocks.queries, "the queries", key)?;
                let mut parts = vec![Payload::device(query.q.clone())];
                if backward {
                    let (out, lse, dout) = query
                        .grads
                        .clone()
                        .ok_or_else(|| self.missing("the output", key))?;
                    parts.extend([
                        Payload::device(out),
                        Payload::device(lse),
                        Payload::device(dout),
                    ]);
                }
                Ok(parts)
            }
            Side::KeyValue => {
                let (k, v) = self.block_keys(key)?;
                Ok(vec![Payload::device(k), Payload::device(v)])
            }
        }
    }

    pub(super) fn store_copy(
        &mut self,
        side: Side,
        key: Key,
        parts: Vec<Payload>,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match side {
            Side::QueryOutput => {
                let q = self.take::<3>(&mut parts)?;
                let grads = match parts.len() == 3 {
                    true => Some((
                        self.take::<3>(&mut parts)?,
                        self.take::<2>(&mut parts)?,
                        self.take::<3>(&mut parts)?,
                    )),
                    false => None,
                };
                self.blocks.queries.insert(key, QuerySide { q, grads });
            }
            Side::KeyValue => {
                let k = self.take::<3>(&mut parts)?;
                let v = self.take::<3>(&mut parts)?;
                self.blocks.keys.insert(key, (k, v));
            }
        }
        Ok(())
    }

    /// The next received part (checked by [`Self::receive`]) as a tensor on this rank's device.
    pub(super) fn take<const D: usize>(
        &self,
        parts: &mut impl Iterator<Item = Payload>,
    ) -> Result<Tensor<B, D>, CpError> {
        let invalid = |message: String| {
            CpError::Comm(CommError::Invalid {
                group: self.comm.name().to_string(),
                message: format!("DCP: a received block {message}"),
            })
        };
        let part = parts
            .next()
            .ok_or_else(|| invalid("has too few parts".into()))?;
        part.into_tensor(&self.device)
            .map_err(|e| invalid(e.to_string()))
    }

    pub(super) fn result_of(
        &self,
        side: Side,
        key: Key,
        backward: bool,
    ) -> Result<Vec<Payload>, CpError> {
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let output = self.held(&self.blocks.outputs, "the partial output", key)?;
                Ok(vec![
                    self.sent(output.out.clone()),
                    Payload::device(output.lse.clone()),
                ])
            }
            (Side::QueryOutput, true) => {
                let dq = self.held(&self.blocks.dq, "the dq", key)?;
                Ok(vec![self.sent(dq.clone())])
            }
            (Side::KeyValue, _) => {
                let (dk, dv) = self.held(&self.blocks.dkv, "the dk/dv", key)?.clone();
                Ok(vec![self.sent(dk), self.sent(dv)])
            }
        }
    }

    pub(super) fn merge_result(
        &mut self,
        side: Side,
        key: Key,
        parts: Vec<Payload>,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match (side, backward) {
            (Side::QueryOutput, false) => {
                let out = self.take::<3>(&mut parts)?;
                let lse = self.take::<2>(&mut parts)?;
                self.merge_output(key, FlashOutput { out, lse })?;
            }
            (Side::QueryOutput, true) => {
                let dq = self.take::<3>(&mut parts)?;
                add_into(&mut self.blocks.dq, key, dq)
            }
            (Side::KeyValue, _) => {
                let dk = self.take::<3>(&mut parts)?;
                let dv = self.take::<3>(&mut parts)?;
                add_pair_into(&mut self.blocks.dkv, key, dk, dv);
            }
        }
        Ok(())
    }

    /// The final results of a head unit homed here, for its token home: `[out, lse]` forward,
    /// `[dq, dk, dv]` backward (a block no tile read: `out` 0, `lse` −∞, gradients 0).
    pub(super) fn unit_result(&mut self, key: Key, backward: bool) -> Vec<Payload> {
        let t = self.tokens(key.0);
        match backward {
            false => {
                let output = self
                    .blocks
                    .outputs
                    .remove(&key)
                    .unwrap_or_else(|| self.empty_output(t));
                vec![self.sent(output.out), Payload::device(output.lse)]
            }
            true => {
                let dq = self.blocks.dq.remove(&key);
                let dq =
                    dq.unwrap_or_else(|| self.zeros([t, self.heads.unit_heads(), self.heads.dim]));
                let (dk, dv) = self
                    .blocks
                    .dkv
                    .remove(&key)
                    .unwrap_or_else(|| self.zero_kv(t));
                vec![self.sent(dq), self.sent(dk), self.sent(dv)]
            }
        }
    }

    /// Stores a head unit's final results received from its home, replacing this rank's
    /// partial of them (which it sent there).
    pub(super) fn replace_results(
        &mut self,
        key: Key,
        parts: Vec<Payload>,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut parts = parts.into_iter();
        match backward {
            false => {
                let out = widened(self.take::<3>(&mut parts)?);
                let lse = self.take::<2>(&mut parts)?;
                self.blocks.outputs.insert(key, FlashOutput { out, lse });
            }
            true => {
                let dq = widened(self.take::<3>(&mut parts)?);
                let dk = widened(self.take::<3>(&mut parts)?);
                let dv = widened(self.take::<3>(&mut parts)?);
                self.blocks.dq.insert(key, dq);
                self.blocks.dkv.insert(key, (dk, dv));
            }
        }
        Ok(())
    }

    /// Zeros in the accumulator dtype (the results' before they are sent or returned).
    pub(super) fn zeros(&self, dims: [usize; 3]) -> Tensor<B, 3> {
        let dtype = accumulator_dtype(self.dtype);
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(dtype);
        filled(dims, 0.0, options)
    }

    /// An accumulated result as a message: in the inputs' dtype.
    pub(super) fn sent(&self, t: Tensor<B, 3>) -> Payload {
        Payload::device(t.cast(self.dtype))
    }

    /// A unit's output of `t` tokens no tile read: `out` 0, `lse` −∞.
    pub(super) fn empty_output(&self, t: usize) -> FlashOutput<B> {
        let h = self.heads.unit_heads();
        let out = self.zeros([t, h, self.heads.dim]);
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
        let lse = filled([h, t], f32::NEG_INFINITY, options);
        FlashOutput { out, lse }
    }

    /// A unit's zero `dk`, `dv` of `t` tokens.
    pub(super) fn zero_kv(&self, t: usize) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let dims = [t, self.heads.unit_kv_heads(), self.heads.dim];
        (self.zeros(dims), self.zeros(dims))
    }

    /// The merged output of every token block of this rank, its units' along the heads.
    pub(super) fn home_outputs(mut self) -> FlashOutput<B> {
        let mut outs = Vec::new();
        let mut lses = Vec::new();
        for (block, range) in self.home_ranges() {
            let (mut unit_outs, mut unit_lses) = (Vec::new(), Vec::new());
            for unit in 0..self.heads.units {
                let output = self.blocks.outputs.remove(&(block, unit));
                let output = output.unwrap_or_else(|| self.empty_output(range.len()));
                unit_outs.push(output.out);
                unit_lses.push(output.lse);
            }
            outs.push(Tensor::cat(unit_outs, 1));
            lses.push(Tensor::cat(unit_lses, 0));
        }
        let h = self.heads;
        outs.push(self.zeros([0, h.whole.heads(), h.dim]));
        let options = TensorCreationOptions::new(self.device.clone()).with_dtype(DType::F32);
        lses.push(Tensor::empty([h.whole.heads(), 0], options));
        FlashOutput {
            out: cat_tokens(outs, 0).cast(self.dtype),
            lse: cat_tokens(lses, 1),
        }
    }

    /// The gradients of every token block of this rank: its units' along the heads, the kv
    /// gradients of units sharing a kv head summed.
    pub(super) fn home_gradients(mut self) -> FlashGradients<B> {
        let h = self.heads;
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        for (block, range) in self.home_ranges() {
            let t = range.len();
            let mut unit_dq = Vec::new();
            let mut unit_dk: Vec<Tensor<B, 3>> = Vec::new();
            let mut unit_dv: Vec<Tensor<B, 3>> = Vec::new();
            for unit in 0..h.units {
                let dq = self.blocks.dq.remove(&(block, unit));
                unit_dq.push(dq.unwrap_or_else(|| self.zeros([t, h.unit_heads(), h.dim])));
                let (dk, dv) = match self.blocks.dkv.remove(&(block, unit)) {
                    Some(pair) => pair,
                    None => self.zero_kv(t),
                };
                // Units sharing a kv head (more units than kv heads) add into it.
                match h.first_kv_head(unit) < unit_dk.len() {
                    true => {
                        let last = unit_dk.len() - 1;
                        unit_dk[last] = unit_dk[last].clone() + dk;
                        unit_dv[last] = unit_dv[last].clone() + dv;
                    }
                    false => {
                        unit_dk.push(dk);
                        unit_dv.push(dv);
                    }
                }
            }
            dqs.push(Tensor::cat(unit_dq, 1));
            dks.push(Tensor::cat(unit_dk, 1));
            dvs.push(Tensor::cat(unit_dv, 1));
        }
        dqs.push(self.zeros([0, h.whole.heads(), h.dim]));
        dks.push(self.zeros([0, h.whole.kv_heads(), h.dim]));
        dvs.push(self.zeros([0, h.whole.kv_heads(), h.dim]));
        FlashGradients {
            dq: cat_tokens(dqs, 0).cast(self.dtype),
            dk: cat_tokens(dks, 0).cast(self.dtype),
            dv: cat_tokens(dvs, 0).cast(self.dtype),
        }
    }

    /// `SendUnit`: the unit's Q and KV, which leave this rank (it is the unit's home's now; a
    /// copy comes back if this rank computes with it).
    pub(super) fn give_unit(&mut self, key: Key, backward: bool) -> Result<Vec<Payload>, CpError> {
        let mut parts = self.copy_of(Side::QueryOutput, key, backward)?;
        parts.extend(self.copy_of(Side::KeyValue, key, backward)?);
        self.blocks.queries.remove(&key);
        self.blocks.keys.remove(&key);
        Ok(parts)
    }

    /// `ReceiveUnit`: a head unit's Q and KV from `from`, stored as this rank's copies.
    pub(super) fn receive_unit(
        &mut self,
        (block, unit): Key,
        from: usize,
        backward: bool,
    ) -> Result<(), CpError> {
        let mut shapes = self.shapes(Side::QueryOutput, block, backward, false);
        let queries = shapes.len();
        shapes.extend(self.shapes(Side::KeyValue, block, backward, false));
        let mut parts = self.receive(from, &shapes, "a head unit")?;
        let keys = parts.split_off(queries);
        self.store_copy(Side::QueryOutput, (block, unit), parts)?;
        self.store_copy(Side::KeyValue, (block, unit), keys)
    }
}

/// Adds `value` into the map's accumulator of `key` (kept in the accumulator dtype).
pub(super) fn add_into<B: FlashOps>(
    map: &mut HashMap<Key, Tensor<B, 3>>,
    key: Key,
    value: Tensor<B, 3>,
) {
    let value = widened(value);
    let sum = match map.remove(&key) {
        Some(previous) => previous + value,
        None => value,
    };
    map.insert(key, sum);
}

pub(super) fn add_pair_into<B: FlashOps>(
    map: &mut HashMap<Key, (Tensor<B, 3>, Tensor<B, 3>)>,
    key: Key,
    dk: Tensor<B, 3>,
    dv: Tensor<B, 3>,
) {
    let (dk, dv) = (widened(dk), widened(dv));
    let sum = match map.remove(&key) {
        Some((k, v)) => (k + dk, v + dv),
        None => (dk, dv),
    };
    map.insert(key, sum);
}

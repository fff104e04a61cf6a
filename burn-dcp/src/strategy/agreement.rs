//! Before any data moves, the ranks of a CP group agree on the attention call: one small control
//! all-gather per call (forward and backward) of the call's configuration — pass, strategy, CP
//! size, layout, sequence lengths, masks, scale, head counts, dims, dtype — and of each rank's
//! own validation result. A rank whose inputs are invalid, or ranks that disagree, make *every*
//! rank fail at once with the same explanation (naming the ranks and the fields), instead of
//! exchanging blocks that do not fit (wrong results) or waiting for messages that never come.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

use burn::tensor::DType;
use burn_dcp_kernels::MaskSpec;

use crate::error::CpError;
use crate::strategy::{CpBatch, CpGroup};

/// The name of the control exchange (it tags the messages).
const EXCHANGE: &str = "attention configuration agreement";
/// Lists longer than this are described by their length, sum and a hash.
const MAX_LISTED: usize = 32;

/// What one rank brings to the agreement.
pub(crate) struct CallConfig {
    fields: Vec<(&'static str, String)>,
}

impl CallConfig {
    /// The configuration of a call of the strategy named `strategy` with tensors of `dims` (`q`,
    /// `k`, `v`) and `dtype`.
    pub(crate) fn new(
        pass: &str,
        strategy: &str,
        group: &CpGroup,
        batch: &CpBatch,
        [q, k, v]: [[usize; 3]; 3],
        dtype: DType,
    ) -> Self {
        let fields = vec![
            ("pass", pass.to_string()),
            ("strategy", strategy.to_string()),
            ("cp size", group.cp().to_string()),
            ("placement", batch.placement.to_string()),
            (
                "block plan",
                batch
                    .blocks
                    .as_ref()
                    .map_or("none".to_string(), |b| format!("{:016x}", b.fingerprint())),
            ),
            ("sequence lengths", describe_list(&batch.placement.seq_lens)),
            ("masks", describe_masks(&batch.masks)),
            ("scale", format!("{:?}", batch.scale)),
            ("q heads", q[1].to_string()),
            ("kv heads", k[1].to_string()),
            ("head dim", q[2].to_string()),
            ("value dim", v[2].to_string()),
            ("dtype", format!("{dtype:?}")),
        ];
        Self { fields }
    }

    fn encode(&self, local: &Result<(), CpError>) -> Vec<u8> {
        let mut lines: Vec<String> = self
            .fields
            .iter()
            .map(|(name, value)| format!("{name}\t{}", one_line(value)))
            .collect();
        if let Err(error) = local {
            lines.push(format!("error\t{}", one_line(&error.to_string())));
        }
        lines.join("\n").into_bytes()
    }
}

/// Exchanges `config` and this rank's validation result `local` with the group; fails (on every
/// rank alike) when a rank's inputs are invalid or the ranks disagree.
pub(crate) fn agree(
    group: &CpGroup,
    config: &CallConfig,
    local: Result<(), CpError>,
) -> Result<(), CpError> {
    let received = group
        .comm
        .all_gather_control(EXCHANGE, config.encode(&local))?;
    local?;
    let decoded: Vec<BTreeMap<String, String>> = received.iter().map(|b| decode(b)).collect();
    let refused: Vec<usize> = (0..decoded.len())
        .filter(|&r| decoded[r].contains_key("error"))
        .collect();
    if let Some(&first) = refused.first() {
        return Err(CpError::Input(format!(
            "CP {} refused the call, so no rank runs it: {}",
            rank_list(group, &refused),
            decoded[first]["error"]
        )));
    }
    let differences: Vec<String> = config
        .fields
        .iter()
        .filter_map(|(name, _)| difference(group, &decoded, name))
        .collect();
    if differences.is_empty() {
        return Ok(());
    }
    Err(CpError::Mismatch(format!(
        "the ranks of CP group '{}' disagree on the attention call before any data moved: {}",
        group.comm.name(),
        differences.join("; ")
    )))
}

/// `field: value on ranks …; other value on ranks …`, if the ranks disagree on `field`.
fn difference(
    group: &CpGroup,
    decoded: &[BTreeMap<String, String>],
    field: &str,
) -> Option<String> {
    let mut by_value: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (rank, fields) in decoded.iter().enumerate() {
        let value = fields.get(field).map_or("(missing)", String::as_str);
        by_value.entry(value).or_default().push(rank);
    }
    if by_value.len() < 2 {
        return None;
    }
    let mut groups: Vec<(&str, Vec<usize>)> = by_value.into_iter().collect();
    groups.sort_by_key(|(_, ranks)| ranks[0]);
    let values: Vec<String> = groups
        .iter()
        .map(|(value, ranks)| format!("{value} on {}", rank_list(group, ranks)))
        .collect();
    Some(format!("{field}: {}", values.join(", ")))
}

/// `rank 2 (global 6)` / `ranks 0, 1 (global 4, 5)`; the global ranks only when they differ.
fn rank_list(group: &CpGroup, ranks: &[usize]) -> String {
    let local: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    let global: Vec<String> = ranks
        .iter()
        .map(|&r| group.comm.global_rank(r).to_string())
        .collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    if local == global {
        format!("{noun} {}", local.join(", "))
    } else {
        format!("{noun} {} (global {})", local.join(", "), global.join(", "))
    }
}

fn decode(bytes: &[u8]) -> BTreeMap<String, String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

fn one_line(text: &str) -> String {
    text.replace(['\n', '\t'], " ")
}

fn describe_list(values: &[usize]) -> String {
    if values.len() <= MAX_LISTED {
        return format!("{values:?}");
    }
    format!(
        "{} values, sum {}, hash {:016x}",
        values.len(),
        values.iter().sum::<usize>(),
        hash_of(values)
    )
}

fn describe_masks(masks: &[MaskSpec]) -> String {
    let names: Vec<String> = masks
        .iter()
        .map(|mask| match mask {
            MaskSpec::KeyRanges(ranges) => {
                let ranges: Vec<_> = ranges
                    .iter()
                    .map(|r| (r.first.clone(), r.second.clone()))
                    .collect();
                format!("{mask}#{:016x}", hash_of(&ranges))
            }
            other => other.to_string(),
        })
        .collect();
    if names.len() <= MAX_LISTED {
        return format!("[{}]", names.join(", "));
    }
    format!("{} masks, hash {:016x}", names.len(), hash_of(&names))
}

/// A hash that is the same in every process of the same build (`DefaultHasher::new` has fixed
/// keys).
fn hash_of<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

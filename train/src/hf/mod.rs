//! Hugging Face checkpoints in the engine: the architecture and initial weights of a run
//! ([`load`]) and the export of its checkpoints ([`export`]).

pub mod export;
pub mod load;

pub use export::{export_checkpoint, ExportFlags, Exporting, HfExport};
pub use load::{parse_rope_scaling, read_hf_config};

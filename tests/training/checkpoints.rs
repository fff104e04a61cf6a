//! Resuming from a checkpoint continues the loss curve exactly (whole or sent in small chunks),
//! a non-finite loss stops every rank naming the step and the rank, and an interrupted save never
//! moves a checkpoint backwards.

use super::*;

#[test]
fn resuming_continues_the_loss_curve_exactly() {
    resume_exactly(
        config(2, 1, Strategy::Ring, Layout::Zigzag, "causal"),
        "cp2",
    );
    // TP shards are saved and loaded per TP rank (model-tp{r}, optimizer-tp{r}).
    let mut tp = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    tp.tp = 2;
    resume_exactly(tp.clone(), "tp2-cp2");
    // And per (TP rank, stage) under PP (model-tp{r}-pp{s}, …), the shards sent to rank 0 in
    // chunks of 1000 bytes.
    let mut pp = tp;
    pp.pp = 2;
    pp.micro_batches = 4;
    pp.checkpoint_chunk_bytes = 1000;
    resume_exactly(pp, "tp2-pp2-cp2");
}

#[test]
fn checkpoints_sent_in_small_chunks_equal_those_sent_whole() {
    // tp 2 × pp 2 × cp 2: six of the eight ranks send their shard to rank 0. A run saved whole
    // is resumed with no step left and saved again in chunks of 1000 bytes (tens of KiB per
    // file: dozens of messages each). (Two separate runs would differ in their random parameter
    // ids.) `resuming_continues_the_loss_curve_exactly` resumes from a chunked save.
    let mut config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    (config.tp, config.pp, config.micro_batches, config.steps) = (2, 2, 4, 2);
    let base = std::env::temp_dir().join(format!("burn-dcp-chunks-{}", std::process::id()));
    let (whole, chunked) = (base.join("whole"), base.join("chunked"));
    train(&config, None, Some(&whole));
    config.checkpoint_chunk_bytes = 1000;
    train(&config, Some(&whole), Some(&chunked));
    let files = |out: &std::path::Path| {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(out.join("checkpoint"))
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).unwrap())
            })
            .filter(|(name, _)| name.ends_with(".mpk"))
            .collect();
        files.sort();
        files
    };
    let (whole, chunked) = (files(&whole), files(&chunked));
    std::fs::remove_dir_all(&base).ok();
    let names: Vec<&str> = whole.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names.len(), 8, "model and optimizer of 4 shards: {names:?}");
    assert!(
        whole.iter().all(|(_, bytes)| bytes.len() > 3 * 1000),
        "every file needs several chunks"
    );
    assert_eq!(chunked.len(), whole.len());
    // Model files byte for byte; optimizer files hold their state in a `HashMap`, whose order
    // differs from save to save: their length here, their content through the exact resume.
    for ((name, a), (_, b)) in whole.iter().zip(&chunked) {
        if name.starts_with("model") {
            assert!(a == b, "{name} differs between chunked and whole sends");
        } else {
            assert_eq!(a.len(), b.len(), "{name}");
        }
    }
    // A chunk size outside 1..=i32::MAX is refused before training.
    for bad in [0, burn_dcp_suite::train::MAX_CHUNK_BYTES + 1] {
        let mut config = config.clone();
        config.checkpoint_chunk_bytes = bad;
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("--checkpoint-chunk-bytes") && err.contains(&bad.to_string()),
            "{err}"
        );
    }
}

/// A NaN that appears on one rank stops the step on every rank with an error naming the step and
/// the rank, instead of training on ("done: loss NaN").
#[test]
fn a_non_finite_loss_stops_training_naming_step_and_rank() {
    use burn::module::Module;
    let config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    let world = InProcessWorld::new(2, WorldConfig::default()).unwrap();
    let data = TrainData::load(&config).unwrap();
    let device = burn::backend::flex::FlexDevice;
    let results = world.run(|comm| -> Result<_, String> {
        let groups = RankGroups::new(comm.clone(), &config).map_err(|e| e.to_string())?;
        let mut model = init_model::<burn::backend::Flex>(&config, 0, 0, &device)?;
        if comm.rank() == 1 {
            model = model.map(&mut Poison);
        }
        step_gradients(&model, &groups, &config, &data, 1, &device)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for result in &results {
        let error = result.as_ref().unwrap_err();
        assert!(
            error.contains("step 1: non-finite values") && error.contains("rank 1: loss sum NaN"),
            "{error}"
        );
    }
}

#[test]
fn checkpoints_never_move_backwards_and_survive_an_interrupted_save() {
    use burn_dcp_suite::train::{check_resume, saved_checkpoint, TrainError};
    let dir = std::env::temp_dir().join(format!("bdcp-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = config(2, 1, Strategy::Ring, Layout::Zigzag, "causal");
    config.steps = 2;
    let straight = {
        let mut three = config.clone();
        three.steps = 3;
        train(&three, None, None)
    };
    let run = dir.join("run");
    train(&config, None, Some(&run));
    // Backwards is refused; equal is allowed (nothing to train); forwards continues exactly.
    let mut back = config.clone();
    back.steps = 1;
    let error = check_resume(&run, &back).unwrap_err();
    assert!(matches!(error, TrainError::Config(_)), "{error:?}");
    assert!(
        error.to_string().contains("never moves backwards"),
        "{error}"
    );
    assert_eq!(check_resume(&run, &config).unwrap(), 2);
    // A checkpoint of another model is refused before burn's loader sees it.
    let mut small = config.clone();
    small.model_size = "small".into();
    small.steps = 3;
    let error = check_resume(&run, &small).unwrap_err();
    assert!(matches!(error, TrainError::Checkpoint(_)), "{error:?}");
    assert!(
        error
            .to_string()
            .contains("d_model: checkpoint 64, configuration 128"),
        "{error}"
    );
    // A save killed between its two renames leaves the previous checkpoint as checkpoint.old,
    // and a save killed while writing leaves a partial checkpoint.tmp: both are handled.
    std::fs::rename(run.join("checkpoint"), run.join("checkpoint.old")).unwrap();
    std::fs::create_dir_all(run.join("checkpoint.tmp")).unwrap();
    std::fs::write(run.join("checkpoint.tmp/model.mpk"), b"partial").unwrap();
    assert_eq!(saved_checkpoint(&run).unwrap(), run.join("checkpoint.old"));
    let mut three = config.clone();
    three.steps = 3;
    let resumed = train(&three, Some(&run), Some(&run));
    assert_eq!(
        resumed,
        straight[2..].to_vec(),
        "resume after an interrupted save"
    );
    assert_eq!(saved_checkpoint(&run).unwrap(), run.join("checkpoint"));
    assert!(!run.join("checkpoint.old").exists() && !run.join("checkpoint.tmp").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

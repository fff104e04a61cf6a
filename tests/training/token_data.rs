//! Training from pre-tokenized data (`--data-path`): a Megatron indexed dataset, a flat token
//! file and a blend of both train the same at cp 4 (and dp 2 × cp 2) as at cp 1; a masked
//! fine-tuning set is exact under CP and its prompts are out of the loss; a user's
//! tokenizer.json trains; a run resumes exactly and refuses data that changed; memory does not
//! grow with the data set.

use std::path::{Path, PathBuf};

use burn_dcp_suite::datasets::corpus::Document;
use burn_dcp_suite::datasets::prepare::{write_token_file, Format};
use burn_dcp_suite::datasets::tokens::mask_path;
use burn_dcp_suite::datasets::{DataError, Tokenizer};

use super::*;

#[path = "../support/cli.rs"]
#[allow(dead_code)]
mod cli;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bdcp-token-data-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The README's paragraphs: real text of many lengths.
fn paragraphs() -> Vec<String> {
    include_str!("../../README.md")
        .split("\n\n")
        .map(str::trim)
        .filter(|p| p.len() > 20)
        .map(str::to_string)
        .collect()
}

fn documents(texts: &[String]) -> impl Iterator<Item = Result<Document, DataError>> + '_ {
    texts.iter().enumerate().map(|(i, text)| {
        Ok(Document {
            name: format!("p{i}"),
            text: text.clone(),
            prompt: None,
        })
    })
}

/// The README in byte tokens, each paragraph ended by id 0: as an indexed set (returns its
/// prefix) or a flat file (returns the file).
fn write(dir: &Path, name: &str, format: Format) -> String {
    let written = write_token_file(
        documents(&paragraphs()),
        &Tokenizer::Bytes,
        &dir.join(name),
        format,
        Some(0),
    )
    .unwrap();
    written.data_path.to_str().unwrap().to_string()
}

fn on_tokens(cp: usize, dp: usize, data_path: &[String]) -> TrainConfig {
    let mut config = config(cp, dp, Strategy::Ring, Layout::Zigzag, "causal");
    config.corpus = "default".into();
    config.data_path = data_path.to_vec();
    config.eod_token = Some(0);
    config
}

#[test]
fn indexed_flat_and_blended_token_files_train_the_same_under_cp() {
    let dir = temp_dir("cp");
    let indexed = write(&dir, "indexed", Format::Indexed);
    let flat = write(&dir, "flat", Format::Flat);
    let blend: Vec<String> = vec!["0.3".into(), indexed.clone(), "0.7".into(), flat.clone()];
    for (what, path) in [
        ("indexed", vec![indexed.clone()]),
        ("flat", vec![flat.clone()]),
        ("blend", blend.clone()),
    ] {
        let reference = one_step(&on_tokens(1, 1, &path));
        let cp4 = one_step(&on_tokens(4, 1, &path));
        assert!(cp4.2 > 0, "{what}: cp 4 communicates");
        assert_same_step(&cp4, &reference, &format!("{what} cp 4"));
        let mut zigzag = on_tokens(2, 2, &path);
        zigzag.mode = TrainMode::Static {
            strategy: Strategy::Ulysses,
            layout: Layout::Contiguous,
        };
        assert_same_step(
            &one_step(&zigzag),
            &reference,
            &format!("{what} dp 2 x cp 2"),
        );
    }
    // The flat file holds the indexed set's tokens: the same window reads the same tokens.
    let (a, b) = (on_tokens(1, 1, &[indexed]), on_tokens(1, 1, &[flat]));
    let (a, b) = (TrainData::load(&a).unwrap(), TrainData::load(&b).unwrap());
    assert_eq!(a.len(), b.len());
    let first = |data: &TrainData| data.step_batches(1, 2).unwrap()[0].tokens.clone();
    assert_eq!(first(&a), first(&b));
    std::fs::remove_dir_all(&dir).ok();
}

/// Prompt/completion pairs: the prompts' tokens are no targets, and the step is exact under CP.
#[test]
fn a_masked_fine_tuning_set_is_exact_under_cp() {
    let dir = temp_dir("masked");
    let texts = paragraphs();
    let jsonl: String = texts
        .iter()
        .map(|text| {
            // Prompts of at most 60 bytes: every window of 150 tokens holds a target.
            let cut = text
                .char_indices()
                .nth((text.chars().count() / 2).min(60))
                .unwrap()
                .0;
            let line = serde_json::json!({"prompt": &text[..cut], "completion": &text[cut..]});
            format!("{line}\n")
        })
        .collect();
    let source = dir.join("sft.jsonl");
    std::fs::write(&source, jsonl).unwrap();
    let documents = burn_dcp_suite::datasets::corpus::jsonl_documents(&source).unwrap();
    let written = write_token_file(
        documents,
        &Tokenizer::Bytes,
        &dir.join("sft"),
        Format::Indexed,
        Some(0),
    )
    .unwrap();
    assert!(written.prompt_tokens > written.tokens / 10, "{written:?}");
    let path = vec![written.data_path.to_str().unwrap().to_string()];
    let reference = one_step(&on_tokens(1, 1, &path));
    assert_same_step(
        &one_step(&on_tokens(4, 1, &path)),
        &reference,
        "masked cp 4",
    );
    assert_same_step(
        &one_step(&on_tokens(2, 2, &path)),
        &reference,
        "masked dp 2 x cp 2",
    );
    // The same jsonl as a text corpus masks alike (prompts tokenized before completions).
    let mut corpus = config(1, 1, Strategy::Ring, Layout::Zigzag, "causal");
    corpus.corpus = source.to_str().unwrap().to_string();
    let corpus_cp1 = one_step(&corpus);
    corpus.cp = 4;
    assert_same_step(&one_step(&corpus), &corpus_cp1, "masked corpus cp 4");
    // The first step with a prompt token: without the mask, the same tokens give more labels
    // and another loss.
    let masked = on_tokens(1, 1, &path);
    let data = TrainData::load(&masked).unwrap();
    let labels = |data: &TrainData, step| -> (usize, usize) {
        let batches = data.step_batches(step, 2).unwrap();
        let unmasked = batches.iter().map(|b| b.tokens.len() - b.sequences()).sum();
        (batches.iter().map(|b| b.label_count()).sum(), unmasked)
    };
    let step = (1..=data.len() / 2)
        .find(|&step| labels(&data, step).0 < labels(&data, step).1)
        .expect("a step with a prompt");
    let device = burn::backend::flex::FlexDevice;
    let with_mask = step_on::<burn::backend::Flex>(&masked, step, &device);
    std::fs::remove_file(mask_path(&written.files[0])).unwrap();
    let plain = TrainData::load(&masked).unwrap();
    assert_eq!(labels(&plain, step).0, labels(&data, step).1);
    let without = step_on::<burn::backend::Flex>(&masked, step, &device);
    assert!(
        (without.0 - with_mask.0).abs() > 1e-4,
        "step {step}: {} vs {}",
        without.0,
        with_mask.0
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A word-level tokenizer.json written here (no download): the corpus is tokenized by it and the
/// model's vocabulary is its size.
#[test]
fn a_tokenizer_json_corpus_trains_the_same_under_cp() {
    let dir = temp_dir("tokenizer");
    let texts = paragraphs();
    let mut words: Vec<String> = texts
        .iter()
        .flat_map(|t| t.split(|c: char| !c.is_alphanumeric()))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect();
    words.sort();
    words.dedup();
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for (id, word) in words.iter().enumerate() {
        vocab.insert(word.clone(), (id + 1).into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, tokenizer.to_string()).unwrap();
    let text = dir.join("text");
    std::fs::create_dir_all(&text).unwrap();
    for (i, paragraph) in texts.iter().enumerate() {
        std::fs::write(text.join(format!("{i:03}.txt")), paragraph).unwrap();
    }
    let mut config = config(1, 1, Strategy::Ring, Layout::Zigzag, "causal");
    config.corpus = text.to_str().unwrap().to_string();
    config.tokenizer_file = Some(file.to_str().unwrap().to_string());
    config.seq_len = 64;
    let loaded = config.tokenizer().unwrap();
    assert_eq!(loaded.vocab_size(), words.len() + 1);
    assert_eq!(config.model_config().unwrap().vocab_size, words.len() + 1);
    let ids = loaded.encode("the README").unwrap();
    assert_eq!(ids.len(), 2, "two words, two ids: {ids:?}");
    let reference = one_step(&config);
    config.cp = 2;
    assert_same_step(&one_step(&config), &reference, "tokenizer.json cp 2");
    let err = Tokenizer::from_file(&dir.join("text/000.txt"))
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("not a Hugging Face tokenizer.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn token_file_runs_resume_exactly_and_refuse_changed_data() {
    let dir = temp_dir("resume");
    let indexed = write(&dir, "indexed", Format::Indexed);
    let flat = write(&dir, "flat", Format::Flat);
    let blend = vec!["1".into(), indexed.clone(), "2".into(), flat.clone()];
    resume_exactly(on_tokens(2, 1, &blend), "token-blend");
    // A checkpoint records where the run stands in each file; a file of another size is refused.
    let out = dir.join("run");
    let mut config = on_tokens(2, 1, std::slice::from_ref(&indexed));
    config.steps = 2;
    train(&config, None, Some(&out));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("checkpoint/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["data"]["micro_batches"], 4, "{state}");
    let mut shorter = paragraphs();
    shorter.truncate(shorter.len() / 2);
    write_token_file(
        documents(&shorter),
        &Tokenizer::Bytes,
        &dir.join("indexed"),
        Format::Indexed,
        Some(0),
    )
    .unwrap();
    config.steps = 3;
    let data = TrainData::load(&config).unwrap();
    let world = InProcessWorld::new(config.world_size(), WorldConfig::default()).unwrap();
    let observer = Quiet(Default::default());
    let errors: Vec<String> = world
        .run(|comm| {
            burn_dcp_suite::train::train_rank::<burn::backend::Flex>(
                comm,
                &config,
                &data,
                Some(&out),
                None,
                &observer,
                &burn::backend::flex::FlexDevice,
            )
        })
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("training data differ from those of the checkpoint")),
        "{errors:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A Megatron indexed dataset of `bytes` bytes of uint16 tokens in sequences of 8192 tokens:
/// the index written, the tokens a sparse file (zeros: no disk blocks, the same bytes to a
/// reader).
fn sparse_indexed(prefix: &Path, bytes: u64) {
    use std::io::Write;
    let tokens = bytes / 2;
    let per = 8192u64;
    let sequences = tokens / per;
    let bin = std::fs::File::create(prefix.with_extension("bin")).unwrap();
    bin.set_len(sequences * per * 2).unwrap();
    let mut idx =
        std::io::BufWriter::new(std::fs::File::create(prefix.with_extension("idx")).unwrap());
    idx.write_all(b"MMIDIDX\0\0").unwrap();
    idx.write_all(&1u64.to_le_bytes()).unwrap();
    idx.write_all(&[8]).unwrap();
    idx.write_all(&sequences.to_le_bytes()).unwrap();
    idx.write_all(&(sequences + 1).to_le_bytes()).unwrap();
    for _ in 0..sequences {
        idx.write_all(&(per as i32).to_le_bytes()).unwrap();
    }
    for s in 0..sequences {
        idx.write_all(&((s * per * 2) as i64).to_le_bytes())
            .unwrap();
    }
    for d in 0..=sequences {
        idx.write_all(&(d as i64).to_le_bytes()).unwrap();
    }
    idx.flush().unwrap();
}

/// gpt_longctx over a 50 MB and a 5 GB token file: the process's peak resident memory (heap
/// and mapped pages) is the same within 10 %.
#[test]
fn memory_does_not_grow_with_the_data_set() {
    let dir = temp_dir("memory");
    let mut peaks = Vec::new();
    for (name, bytes) in [("small", 50u64 << 20), ("large", 5u64 << 30)] {
        let prefix = dir.join(name);
        sparse_indexed(&prefix, bytes);
        let prefix = prefix.to_str().unwrap().to_string();
        let args = [
            "--data-path",
            &prefix,
            "--steps",
            "3",
            "--cp",
            "2",
            "--seq-len",
            "512",
            "--json",
            "--timeout-secs",
            "120",
        ];
        let summary: serde_json::Value =
            serde_json::from_str(&cli::succeeded("gpt_longctx", &args)).unwrap();
        let peak = summary["process_peak_rss_mb"]
            .as_f64()
            .expect("Linux reports VmHWM");
        assert_eq!(summary["steps_run"], 3, "{summary}");
        peaks.push(peak);
        for extension in ["bin", "idx"] {
            std::fs::remove_file(Path::new(&prefix).with_extension(extension)).ok();
        }
    }
    eprintln!(
        "peak resident memory: 50 MB data {:.1} MiB, 5 GB data {:.1} MiB",
        peaks[0], peaks[1]
    );
    assert!(
        (peaks[1] - peaks[0]).abs() <= 0.1 * peaks[0],
        "peak resident memory {:.1} MiB (50 MB) vs {:.1} MiB (5 GB)",
        peaks[0],
        peaks[1]
    );
    std::fs::remove_dir_all(&dir).ok();
}

//! Packing puts every token in exactly one micro-batch (property test); cu_seqlens, positions and
//! labels agree; the mask specs match a naive dense mask; loaders reject malformed input naming the
//! file and line.

use std::io::Write;

use burn_dcp_datasets::corpus::{jsonl_documents, read_text_file, text_directory, Document};
use burn_dcp_datasets::masks::{blockwise_default, lambda_default, shared_question_default};
use burn_dcp_datasets::packing::{pack_pieces, split_documents};
use burn_dcp_datasets::{pack_corpus, MaskPolicy, MaskSpec, PackingConfig, TokenizedCorpus};
use proptest::prelude::*;

fn corpus(lengths: &[usize]) -> TokenizedCorpus {
    TokenizedCorpus {
        names: (0..lengths.len()).map(|i| format!("doc{i}")).collect(),
        // Token value encodes (document, position) so placement can be checked exactly.
        documents: lengths
            .iter()
            .enumerate()
            .map(|(d, &len)| (0..len).map(|p| (d * 100_000 + p) as u32).collect())
            .collect(),
        prompts: Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_token_lands_in_exactly_one_micro_batch(
        lengths in proptest::collection::vec(0usize..3000, 1..40),
        per_rank in 1usize..600,
        ranks in 1usize..5,
        max_seq_len in proptest::option::of(1usize..2000),
        seed in 0u64..1000,
    ) {
        let config = PackingConfig { max_tokens_per_rank: per_rank, ranks, max_seq_len, seed };
        let corpus = corpus(&lengths);
        let packing = pack_corpus(&corpus, &config, &MaskPolicy::Same(MaskSpec::Causal)).unwrap();
        let mut seen: Vec<Vec<u8>> = lengths.iter().map(|&l| vec![0; l]).collect();
        for batch in &packing.micro_batches {
            prop_assert!(batch.tokens.len() <= config.budget());
            prop_assert_eq!(batch.cu_seqlens[0], 0);
            prop_assert_eq!(*batch.cu_seqlens.last().unwrap(), batch.tokens.len());
            prop_assert_eq!(batch.masks.len(), batch.pieces.len());
            for (s, w) in batch.cu_seqlens.windows(2).enumerate() {
                prop_assert!(w[1] - w[0] <= config.max_seq_len());
                prop_assert!(w[1] > w[0]);
                for t in w[0]..w[1] {
                    let position = t - w[0];
                    prop_assert_eq!(batch.positions[t], position);
                    let expected_label = if t + 1 < w[1] { batch.tokens[t + 1] as i64 } else { -1 };
                    prop_assert_eq!(batch.labels[t], expected_label);
                    let (doc, at) = ((batch.tokens[t] / 100_000) as usize, (batch.tokens[t] % 100_000) as usize);
                    prop_assert_eq!(doc, batch.pieces[s].doc);
                    seen[doc][at] += 1;
                }
            }
        }
        prop_assert!(seen.iter().flatten().all(|&n| n == 1), "a token is missing or duplicated");
    }

    #[test]
    fn packing_is_deterministic(lengths in proptest::collection::vec(1usize..500, 1..30), seed in 0u64..100) {
        let pieces = split_documents(&lengths, 300);
        prop_assert_eq!(pack_pieces(pieces.clone(), 700, seed), pack_pieces(pieces, 700, seed));
    }
}

#[test]
fn dcp_default_masks_match_a_naive_dense_mask() {
    // The rules as written in the DCP paper's evaluation, evaluated densely.
    let len = 1500;
    type Rule = Box<dyn Fn(usize, usize) -> bool>;
    let naive: [(MaskSpec, Rule); 3] = [
        (
            lambda_default(),
            Box::new(|i, j| j <= i && (j < 64 || i - j < 4096)),
        ),
        (
            blockwise_default(),
            // DCP's causal-blockwise: causal in the first and last of the ⌈1500/256⌉ = 6
            // blocks; elsewhere the sink block and a window of 2·256 tokens.
            Box::new(|i, j| {
                let edge = i / 256 == 0 || i / 256 == 5;
                j <= i && (edge || j < 256 || j + 512 >= i)
            }),
        ),
        (
            shared_question_default(),
            Box::new(move |i, j| {
                let q = 300; // 20% of 1500
                let answer = |x: usize| (x >= q).then(|| ((x - q) / 300).min(3));
                match (answer(i), answer(j)) {
                    (None, None) => j <= i,
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (Some(a), Some(b)) => a == b && j <= i,
                }
            }),
        ),
    ];
    for (spec, rule) in &naive {
        for i in (0..len).step_by(7) {
            let ranges = spec.key_ranges(i, len);
            for j in 0..len {
                assert_eq!(ranges.contains(j), rule(i, j), "{spec} i {i} j {j}");
            }
        }
    }
}

fn temp(name: &str, content: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bdcp-datasets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(content)
        .unwrap();
    path
}

/// Every document of the JSON lines `content`, written to the temporary file `name`.
fn jsonl(name: &str, content: &[u8]) -> Vec<Document> {
    jsonl_documents(&temp(name, content))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn jsonl_loader_reads_text_and_chat_and_names_bad_lines() {
    let docs = jsonl(
        "good.jsonl",
        b"{\"text\": \"hello\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
    );
    assert_eq!(docs[0].text, "hello");
    assert_eq!(docs[1].text, "user: hi\n\nassistant: yo");
    let pair = jsonl(
        "pair.jsonl",
        b"{\"prompt\": \"Q: 2+2?\", \"completion\": \" A: 4\"}\n",
    );
    assert_eq!(
        (pair[0].prompt.as_deref(), pair[0].text.as_str()),
        (Some("Q: 2+2?"), " A: 4")
    );
    assert_eq!(docs[0].prompt, None);
    for (content, reason) in [
        (
            "{\"text\": \"ok\"}\n{\"text\": 3}\n",
            "\"text\" must be a string",
        ),
        ("{\"text\": \"ok\"}\nnot json\n", "not valid JSON"),
        (
            "{\"text\": \"ok\"}\n{\"other\": 1}\n",
            "expected a \"text\" string, \"prompt\" and \"completion\" strings, or a \"messages\" array",
        ),
        (
            "{\"text\": \"ok\"}\n{\"prompt\": \"q\"}\n",
            "needs string fields \"prompt\" and \"completion\" (\"completion\" is missing",
        ),
        (
            "{\"text\": \"ok\"}\n{\"messages\": [{\"role\": \"user\"}]}\n",
            "message 0 needs string fields",
        ),
    ] {
        let path = temp("bad.jsonl", content.as_bytes());
        let err = jsonl_documents(&path)
            .unwrap()
            .find_map(Result::err)
            .expect("an error")
            .to_string();
        assert!(
            err.contains("bad.jsonl:2:") && err.contains(reason),
            "{err}"
        );
    }
}

#[test]
fn text_loader_names_the_line_of_invalid_utf8() {
    let path = temp("latin1.txt", b"line one\nline two\nbad \xff byte\n");
    let err = read_text_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("latin1.txt:3:") && err.contains("invalid UTF-8"),
        "{err}"
    );
    let dir = path.parent().unwrap();
    assert!(text_directory(dir).unwrap().any(|d| d.is_err()));
}

/// The default corpus is installed by `.ci/run` (Debian vim-runtime); without it this test fails
/// with the install hint rather than passing silently.
#[test]
fn the_default_corpus_is_long_tailed_and_packs_efficiently() {
    use burn_dcp_datasets::corpus::default_corpus;
    use burn_dcp_datasets::packing::packing_efficiency;
    use burn_dcp_datasets::stats::LengthStats;
    use burn_dcp_datasets::Tokenizer;

    let documents = default_corpus().unwrap_or_else(|e| panic!("{e}"));
    let corpus = TokenizedCorpus::tokenize(documents, &Tokenizer::Bytes).unwrap();
    let lengths = corpus.lengths();
    let stats = LengthStats::of(&lengths);
    assert!(stats.documents >= 100, "{stats:?}");
    assert!(
        stats.max >= 32768 && stats.p90 >= 3 * stats.p50,
        "{stats:?}"
    );
    let config = PackingConfig {
        max_tokens_per_rank: 16384,
        ranks: 4,
        max_seq_len: None,
        seed: 0,
    };
    let (efficiency, _) = packing_efficiency(&lengths, &config).unwrap();
    assert!(efficiency >= 0.95, "packing efficiency {efficiency}");
}

#[test]
fn the_prefetcher_yields_the_dataset_in_order() {
    use burn_dcp_datasets::dataset::{PackedDataset, Prefetcher};

    let config = PackingConfig {
        max_tokens_per_rank: 50,
        ranks: 2,
        max_seq_len: None,
        seed: 3,
    };
    let packing = pack_corpus(&corpus(&[120, 7, 33, 90, 5]), &config, &MaskPolicy::Mixed).unwrap();
    let expected = packing.micro_batches.clone();
    let got: Vec<_> = Prefetcher::new(PackedDataset::new(packing), 2).collect();
    assert_eq!(got, expected);
    // Dropping a prefetcher before the end stops its worker.
    let packing = pack_corpus(&corpus(&[500; 20]), &config, &MaskPolicy::Mixed).unwrap();
    let mut early = Prefetcher::new(PackedDataset::new(packing), 1);
    assert!(early.next().is_some());
    drop(early);
}

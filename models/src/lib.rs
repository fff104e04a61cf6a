//! Models for burn-dcp: a GPT for long-context training (token embedding, RoPE with global
//! positions, pre-norm blocks calling burn's `attention` op, GQA, MLP, LM head).
//!
//! Not implemented yet: it comes with the `ContextParallel<B>` decorator issue. The crate exists so
//! the workspace layout is in place.

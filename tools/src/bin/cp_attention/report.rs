//! The run's summary (`--json`) and its text form.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(crate) fn summarize(
    args: &Args,
    inputs: &PackedInputs,
    spec: &RunSpec,
    report: &RunReport,
    reference: &PackedOutputs,
    reference_ms: f64,
    emulation: Option<&Emulation>,
) -> Result<serde_json::Value, String> {
    let got = &report.outputs;
    let placement =
        Placement::of_layout(&inputs.seq_lens, spec.cp, spec.layout).map_err(|e| e.to_string())?;
    let shape = VolumeShape {
        heads: inputs.heads,
        kv_heads: inputs.kv_heads,
        head_dim: inputs.head_dim,
        value_dim: inputs.value_dim,
        element_bytes: 4,
    };
    let analytic = match &spec.blocks {
        Some(schedule) => schedule
            .predicted_volume(inputs.heads, inputs.kv_heads, inputs.head_dim)
            .map_err(|e| e.to_string())?,
        None => analytic_volume(spec.strategy, &placement, &shape),
    };
    let links = |links: Vec<LinkBytes>| {
        json!({
            "intra_node": links.iter().map(|l| l.intra_node).collect::<Vec<_>>(),
            "inter_node": links.iter().map(|l| l.inter_node).collect::<Vec<_>>(),
        })
    };
    let measured_links = links(report.stats.iter().map(|s| s.bytes_by_link).collect());
    let predicted_links = match &spec.blocks {
        Some(schedule) => links(
            schedule
                .predicted_links(inputs.heads, inputs.kv_heads, inputs.head_dim)
                .map_err(|e| e.to_string())?,
        ),
        None => serde_json::Value::Null,
    };
    let total: Vec<u64> = report
        .bytes_forward
        .iter()
        .zip(&report.bytes_backward)
        .map(|(f, b)| f + b)
        .collect();
    let non_finite = [&inputs.q, &inputs.k, &inputs.v, &inputs.dout]
        .iter()
        .any(|values| values.iter().any(|v| !v.is_finite()));
    let (ulysses_degree, ring_degree) = match spec.strategy {
        Strategy::Ulysses => (spec.cp, 1),
        Strategy::Usp {
            ulysses_degree,
            ring_degree,
        } => (ulysses_degree, ring_degree),
        Strategy::Ring | Strategy::AllGather | Strategy::Dcp => (1, spec.cp),
    };
    Ok(json!({
        "mode": if args.inputs.is_some() { "inputs" } else { "random" },
        "strategy": args.strategy,
        "layout": if spec.blocks.is_some() { "dcp plan".to_string() } else { spec.layout.to_string() },
        "cp": spec.cp,
        "head_units": spec.blocks.as_ref().map_or(1, |schedule| schedule.units),
        "ulysses_degree": ulysses_degree,
        "ring_degree": ring_degree,
        "heads": inputs.heads,
        "kv_heads": inputs.kv_heads,
        "head_dim": inputs.head_dim,
        "seqlens": inputs.seq_lens,
        "tokens": inputs.tokens(),
        "mask": spec.masks[0].to_string(),
        "backend": args.backend,
        "dtype": args.dtype,
        "backend_type": burn_dcp_tools::backend_type(
        &args.backend,
        args.no_fusion,
        "-p burn-dcp-tools --bin cp_attention",
    )?,
        "seed": args.seed,
        "non_finite_inputs": non_finite,
        "max_rel_err": {
            "out": max_rel_err(&got.out, &reference.out),
            "lse": max_rel_err(&got.lse, &reference.lse),
            "dq": max_rel_err(&got.dq, &reference.dq),
            "dk": max_rel_err(&got.dk, &reference.dk),
            "dv": max_rel_err(&got.dv, &reference.dv),
        },
        "bytes_sent_per_rank": total,
        "bytes_forward_per_rank": report.bytes_forward,
        "bytes_backward_per_rank": report.bytes_backward,
        "analytic_bytes_per_rank": analytic.iter().map(|v| v.forward + v.backward).collect::<Vec<_>>(),
        "topology": args.topology,
        "nodes": args.nodes,
        "bytes_by_link": measured_links,
        "predicted_bytes_by_link": predicted_links,
        "timings_ms": {
            "cp_forward": report.forward_ms,
            "cp_backward": report.backward_ms,
            "reference_forward_backward": reference_ms,
        },
        "emulate_links": emulation.is_some(),
        "link_scale": emulation.map(|e| e.scale),
        "measured_attention_ms": report.attention_ms,
        "predicted_attention_ms": emulation.and_then(|e| e.predicted).map(|(f, b)| f + b),
        "predicted_forward_ms": emulation.and_then(|e| e.predicted).map(|(f, _)| f),
        "predicted_backward_ms": emulation.and_then(|e| e.predicted).map(|(_, b)| b),
        "predicted_link_bytes": emulation.and_then(|e| e.predicted_link_bytes).map(|(intra, inter)| {
            json!({"intra_node": intra, "inter_node": inter})
        }),
    }))
}

pub(crate) fn print_text(summary: &serde_json::Value) {
    println!(
        "{} ({} layout), cp {} [ulysses {} x ring {}], H {} K {} D {}, seqlens {}, mask {}",
        summary["strategy"].as_str().unwrap_or_default(),
        summary["layout"].as_str().unwrap_or_default(),
        summary["cp"],
        summary["ulysses_degree"],
        summary["ring_degree"],
        summary["heads"],
        summary["kv_heads"],
        summary["head_dim"],
        summary["seqlens"],
        summary["mask"].as_str().unwrap_or_default()
    );
    println!("max relative error vs single device:");
    for name in ["out", "lse", "dq", "dk", "dv"] {
        println!(
            "  {name:<4} {:.3e}",
            summary["max_rel_err"][name].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!(
        "bytes sent per rank:     {}",
        summary["bytes_sent_per_rank"]
    );
    println!(
        "analytic bytes per rank: {}",
        summary["analytic_bytes_per_rank"]
    );
    let t = &summary["timings_ms"];
    println!(
        "time: cp forward {:.1} ms, cp backward {:.1} ms, single-device forward+backward {:.1} ms",
        t["cp_forward"].as_f64().unwrap_or(0.0),
        t["cp_backward"].as_f64().unwrap_or(0.0),
        t["reference_forward_backward"].as_f64().unwrap_or(0.0)
    );
    if let Some(scale) = summary["link_scale"].as_f64() {
        println!(
            "emulated links (scale {scale:.0}): attention measured {:.1} ms, predicted {}",
            summary["measured_attention_ms"].as_f64().unwrap_or(0.0),
            match summary["predicted_attention_ms"].as_f64() {
                Some(ms) => format!("{ms:.1} ms"),
                None => "(no plan of this strategy in the cost model)".into(),
            }
        );
    }
}

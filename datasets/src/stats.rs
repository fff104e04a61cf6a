//! Length statistics: percentiles and a log-scale histogram (text and SVG).

/// Summary of a list of lengths.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LengthStats {
    pub documents: usize,
    pub tokens: usize,
    pub p50: usize,
    pub p90: usize,
    pub p99: usize,
    pub max: usize,
}

/// Nearest-rank percentile of sorted values (`p` in 0..=1).
pub fn percentile(sorted: &[usize], p: f64) -> usize {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl LengthStats {
    pub fn of(lengths: &[usize]) -> Self {
        let mut sorted = lengths.to_vec();
        sorted.sort_unstable();
        Self {
            documents: sorted.len(),
            tokens: sorted.iter().sum(),
            p50: percentile(&sorted, 0.5),
            p90: percentile(&sorted, 0.9),
            p99: percentile(&sorted, 0.99),
            max: sorted.last().copied().unwrap_or(0),
        }
    }
}

/// Counts per power-of-two bucket: `(lower bound, count)` for buckets `[2^k, 2^(k+1))`.
pub fn log2_histogram(lengths: &[usize]) -> Vec<(usize, usize)> {
    let Some(&max) = lengths.iter().max() else {
        return Vec::new();
    };
    let buckets = (usize::BITS - max.max(1).leading_zeros()) as usize;
    let mut counts = vec![0usize; buckets];
    for &len in lengths {
        let bucket = (usize::BITS - len.max(1).leading_zeros()) as usize - 1;
        counts[bucket] += 1;
    }
    counts
        .into_iter()
        .enumerate()
        .map(|(k, count)| (1usize << k, count))
        .collect()
}

/// The histogram as text bars.
pub fn histogram_text(histogram: &[(usize, usize)]) -> String {
    let top = histogram.iter().map(|&(_, c)| c).max().unwrap_or(0).max(1);
    histogram
        .iter()
        .map(|&(low, count)| {
            format!(
                "{:>8} – {:<8} {:>6} {}\n",
                low,
                2 * low - 1,
                count,
                "#".repeat(count * 50 / top)
            )
        })
        .collect()
}

/// The histogram as an SVG bar chart.
pub fn histogram_svg(histogram: &[(usize, usize)], title: &str) -> String {
    let (width, height, margin) = (720.0, 360.0, 50.0);
    let top = histogram.iter().map(|&(_, c)| c).max().unwrap_or(0).max(1) as f64;
    let bar = (width - 2.0 * margin) / histogram.len().max(1) as f64;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{}</text>\n",
        width / 2.0,
        escape(title)
    );
    for (i, &(low, count)) in histogram.iter().enumerate() {
        let h = (height - 2.0 * margin) * count as f64 / top;
        let x = margin + i as f64 * bar;
        svg += &format!(
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"#4a7ab5\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{count}</text>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            height - margin - h,
            bar * 0.9,
            x + bar * 0.45,
            height - margin - h - 4.0,
            x + bar * 0.45,
            height - margin + 14.0,
            short(low)
        );
    }
    svg += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">length in tokens (bucket lower bound, powers of two)</text>\n</svg>\n",
        width / 2.0,
        height - 10.0
    );
    svg
}

fn short(n: usize) -> String {
    match n {
        n if n >= 1 << 20 => format!("{}M", n >> 20),
        n if n >= 1 << 10 => format!("{}k", n >> 10),
        n => n.to_string(),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_buckets() {
        let stats = LengthStats::of(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 100]);
        assert_eq!(
            (stats.p50, stats.p90, stats.p99, stats.max, stats.tokens),
            (5, 9, 100, 100, 145)
        );
        assert_eq!(
            log2_histogram(&[1, 2, 3, 4, 100]),
            vec![(1, 1), (2, 2), (4, 1), (8, 0), (16, 0), (32, 0), (64, 1)]
        );
    }
}

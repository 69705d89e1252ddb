//! Reading vLLM's Prometheus text exposition: the few counters the cases compare before and after.

/// The sum of every sample of `name` whose labels include all of `want` (`key="value"` pairs).
/// `None` when no sample matches (a counter vLLM does not export is an error for the caller).
pub fn sum(text: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(inner) => match inner.split_once('}') {
                Some((labels, value)) => (labels, value),
                None => continue,
            },
            // Not a prefix of a longer metric name: the value follows directly.
            None if rest.starts_with(' ') => ("", rest),
            None => continue,
        };
        let matches = want
            .iter()
            .all(|(k, v)| labels.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
        if !matches {
            continue;
        }
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            total = Some(total.unwrap_or(0.0) + v);
        }
    }
    total
}

/// Quantile `q` (0..=1) of a Prometheus histogram's samples, by linear interpolation inside the
/// bucket, as `histogram_quantile` does. `None` without samples.
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let bucket = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(&bucket) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let le = labels
            .split(',')
            .find_map(|p| p.strip_prefix("le=\""))
            .map(|v| v.trim_end_matches('"'));
        let (Some(le), Some(count)) = (
            le,
            value
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok()),
        ) else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some(entry) => entry.1 += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in &buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let span = count - prev.1;
            let frac = if span > 0.0 {
                (rank - prev.1) / span
            } else {
                0.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    None
}

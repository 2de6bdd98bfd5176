//! Small statistics over measured samples.

/// The `q`-quantile (0.0..=1.0) of `samples` by nearest rank; NaN when empty.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(|a, b| a.partial_cmp(b).expect("no NaN samples"));
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// Microseconds since the Unix epoch (all timestamps of one run come from one process).
pub fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970").as_micros() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut s, 0.5), 50.0);
        assert_eq!(quantile(&mut s, 0.99), 99.0);
        assert_eq!(quantile(&mut s, 1.0), 100.0);
        assert!(quantile(&mut [], 0.5).is_nan());
    }
}

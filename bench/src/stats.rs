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

/// The median over rounds of `value(a) / value(b)` within each round: `a` and `b` are two cases'
/// runs, in round order. Runs of one round are minutes apart at most, while this machine's speed
/// drifts between rounds by more than the differences measured; pairing them cancels it. NaN
/// when no round has both.
pub fn paired_ratio<T>(a: &[T], b: &[T], value: impl Fn(&T) -> f64) -> f64 {
    median(a.iter().zip(b).map(|(a, b)| value(a) / value(b)).collect())
}

/// The median of the finite `values`; NaN when there is none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The runs of a case in rounds, every other round in reverse order (so that the machine's
/// drift over a round weighs on both ends of a ratio alike): `run(i)` runs case `i` of `cases`,
/// and the result holds each case's runs in round order.
pub async fn in_rounds<T, F, Fut>(cases: usize, rounds: usize, mut run: F) -> Vec<Vec<T>>
where
    F: FnMut(usize, usize) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut runs: Vec<Vec<T>> = (0..cases).map(|_| Vec::with_capacity(rounds)).collect();
    for round in 1..=rounds {
        let mut order: Vec<usize> = (0..cases).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        for i in order {
            runs[i].push(run(round, i).await);
        }
    }
    runs
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

    #[test]
    fn a_paired_ratio_cancels_the_drift_between_rounds() {
        // The machine speeds up and slows down from round to round; b is always 0.9 times a.
        let a = [100.0, 150.0, 120.0, 200.0, 90.0];
        let b = [90.0, 135.0, 108.0, 180.0, 81.0];
        assert!((paired_ratio(&a, &b, |x| *x) - 1.0 / 0.9).abs() < 1e-9);
        // One slow run of one side moves one round's ratio, not the median.
        let slow_b = [90.0, 135.0, 50.0, 180.0, 81.0];
        assert!((paired_ratio(&a, &slow_b, |x| *x) - 1.0 / 0.9).abs() < 1e-9);
        assert!(paired_ratio(&a, &[], |x| *x).is_nan());
        assert_eq!(paired_ratio(&[2.0, 4.0], &[1.0, 1.0], |x| *x), 3.0);
    }

    #[test]
    fn rounds_alternate_their_order() {
        let mut seen = vec![];
        let runs = futures_executor_lite(in_rounds(3, 2, |round, i| {
            seen.push((round, i));
            std::future::ready(round * 10 + i)
        }));
        assert_eq!(seen, [(1, 0), (1, 1), (1, 2), (2, 2), (2, 1), (2, 0)]);
        assert_eq!(runs, [vec![10, 20], vec![11, 21], vec![12, 22]]);
    }

    /// Runs a future that never waits.
    fn futures_executor_lite<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }
}

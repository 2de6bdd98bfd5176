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

/// How `a` compares with `b` over rounds run by `in_rounds`: each round's ratio
/// `value(a) / value(b)`, each forward (odd) round's joined with the reversed round's after it by
/// their geometric mean, and the median of those pairs, taken on a log scale so that the ratio of
/// `b` to `a` is exactly the inverse (with two pairs, their geometric mean). The runs of one round
/// are minutes apart at most, while this machine's speed drifts between rounds by more than the
/// differences measured: the ratio within a round cancels the drift between rounds. The two
/// rounds of a pair run the cases in opposite orders, so joining them also cancels a drift within
/// a round, which would favour whichever case ran later. A last round without its pair counts
/// alone; NaN when no round has both cases.
pub fn paired_ratio<T>(a: &[T], b: &[T], value: impl Fn(&T) -> f64) -> f64 {
    let rounds: Vec<f64> = a.iter().zip(b).map(|(a, b)| (value(a) / value(b)).ln()).collect();
    median(rounds.chunks(2).map(|pair| pair.iter().sum::<f64>() / pair.len() as f64).collect()).exp()
}

/// The run with the median `key`, the upper of the two middle runs of an even count; None when
/// there is none.
pub fn median_by<T>(mut runs: Vec<T>, key: impl Fn(&T) -> f64) -> Option<T> {
    runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let n = runs.len();
    runs.into_iter().nth(n / 2)
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
        let a = [100.0, 150.0, 120.0, 200.0, 90.0, 130.0];
        let b = [90.0, 135.0, 108.0, 180.0, 81.0, 117.0];
        assert!((paired_ratio(&a, &b, |x| *x) - 1.0 / 0.9).abs() < 1e-9);
        // One slow run of one side moves one pair, not the median.
        let slow_b = [90.0, 135.0, 50.0, 180.0, 81.0, 117.0];
        assert!((paired_ratio(&a, &slow_b, |x| *x) - 1.0 / 0.9).abs() < 1e-9);
        assert!(paired_ratio(&a, &[], |x| *x).is_nan());
        assert_eq!(paired_ratio(&[2.0], &[1.0], |x| *x), 2.0);
        // A last round without its pair counts alone: pairs 2 and 3, median their geometric mean.
        assert!((paired_ratio(&[2.0, 2.0, 3.0], &[1.0, 1.0, 1.0], |x| *x) - 6f64.sqrt()).abs() < 1e-9);
        // The ratio of b to a is the inverse of a to b, with an even count of pairs too.
        let (x, y) = ([1.0, 1.0, 2.0, 2.0], [1.0; 4]);
        assert!((paired_ratio(&x, &y, |v| *v) * paired_ratio(&y, &x, |v| *v) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_paired_ratio_cancels_the_drift_within_a_round() {
        // a and b are equal, but whichever runs second in a round runs 10% faster: a runs first
        // in the forward rounds (1, 3, 5), second in the reversed ones.
        let a = [100.0, 110.0, 100.0, 110.0, 100.0, 110.0];
        let b = [110.0, 100.0, 110.0, 100.0, 110.0, 100.0];
        assert!((paired_ratio(&a, &b, |x| *x) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_median_run() {
        let runs = vec![(3, 30.0), (1, 10.0), (2, 20.0), (4, 40.0)];
        assert_eq!(median_by(runs.clone(), |r| r.1), Some((3, 30.0)));
        assert_eq!(median_by(runs[..3].to_vec(), |r| r.1), Some((2, 20.0)));
        assert_eq!(median_by(Vec::<(i32, f64)>::new(), |r| r.1), None);
    }

    #[test]
    fn rounds_alternate_their_order() {
        let mut seen = vec![];
        let runs = block_on(in_rounds(3, 2, |round, i| {
            seen.push((round, i));
            std::future::ready(round * 10 + i)
        }));
        assert_eq!(seen, [(1, 0), (1, 1), (1, 2), (2, 2), (2, 1), (2, 0)]);
        assert_eq!(runs, [vec![10, 20], vec![11, 21], vec![12, 22]]);
    }

    /// Runs a future that never waits.
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }
}

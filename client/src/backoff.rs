//! The one reconnect backoff of the client: exponential from 100 ms to 5 s, with full jitter so
//! many consumers that lost the same server do not come back in step.

use std::time::Duration;

const FIRST: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(crate) struct Backoff {
    ceiling: Duration,
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff { ceiling: FIRST }
    }

    /// The next wait: uniform in [ceiling / 2, ceiling], then the ceiling doubles (up to 5 s).
    pub fn next(&mut self) -> Duration {
        let ceiling = self.ceiling;
        self.ceiling = (ceiling * 2).min(MAX);
        let half = ceiling / 2;
        half + half.mul_f64(jitter())
    }

    pub fn reset(&mut self) {
        self.ceiling = FIRST;
    }
}

/// A number in [0, 1), different for every call and process.
fn jitter() -> f64 {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_grow_to_the_ceiling_with_jitter_and_reset() {
        let mut b = Backoff::new();
        let first = b.next();
        assert!(first >= FIRST / 2 && first <= FIRST);
        for _ in 0..10 {
            let wait = b.next();
            assert!(wait <= MAX && wait >= FIRST / 2);
        }
        let late = b.next();
        assert!(late >= MAX / 2);
        b.reset();
        assert!(b.next() <= FIRST);
    }
}

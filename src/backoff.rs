//! Retry backoff and the outcome of a failure against a group's budgets. Pure logic.

/// A group's retry settings, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    pub base_micros: i64,
    pub cap_micros: i64,
    pub exponent: f64,
}

impl Backoff {
    /// Wait before the retry that follows failure number `attempts` (1 for the first failure):
    /// `min(cap, base * exponent^(attempts - 1))`.
    pub fn delay_micros(&self, attempts: i32) -> i64 {
        let steps = (attempts.max(1) - 1) as f64;
        let delay = self.base_micros as f64 * self.exponent.powf(steps);
        if !delay.is_finite() || delay >= self.cap_micros as f64 {
            self.cap_micros
        } else {
            (delay as i64).max(0)
        }
    }
}

/// What a failure does to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureOutcome {
    /// Run again at `can_run_after` (microseconds since the Postgres epoch).
    Retry { attempts: i32, can_run_after: i64 },
    /// Dead-lettered: permanent, or the retry budget is spent.
    Dead { attempts: i32 },
}

/// Applies one failure to a message that had failed `previous_attempts` times.
/// `max_retries` retries follow the first run, so the budget is spent when
/// `attempts > max_retries`. `retry_after` overrides the backoff for this one retry.
pub fn fail(
    backoff: &Backoff,
    max_retries: i32,
    previous_attempts: i32,
    permanent: bool,
    retry_after_micros: Option<i64>,
    now: i64,
) -> FailureOutcome {
    let attempts = previous_attempts + 1;
    if permanent || attempts > max_retries {
        return FailureOutcome::Dead { attempts };
    }
    let wait = retry_after_micros.unwrap_or_else(|| backoff.delay_micros(attempts));
    FailureOutcome::Retry { attempts, can_run_after: now.saturating_add(wait.max(0)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: i64 = 1_000_000;
    const B: Backoff = Backoff { base_micros: SECOND, cap_micros: 60 * SECOND, exponent: 2.0 };

    #[test]
    fn backoff_grows_exponentially_up_to_the_cap() {
        assert_eq!(B.delay_micros(1), SECOND);
        assert_eq!(B.delay_micros(2), 2 * SECOND);
        assert_eq!(B.delay_micros(3), 4 * SECOND);
        assert_eq!(B.delay_micros(6), 32 * SECOND);
        assert_eq!(B.delay_micros(7), 60 * SECOND);
        assert_eq!(B.delay_micros(10_000), 60 * SECOND);
        let flat = Backoff { exponent: 1.0, ..B };
        assert_eq!(flat.delay_micros(9), SECOND);
    }

    #[test]
    fn default_budget_allows_four_runs() {
        // max_retries = 3: the first run and three retries fail, the fourth failure is dead.
        let mut attempts = 0;
        let mut outcomes = vec![];
        loop {
            let outcome = fail(&B, 3, attempts, false, None, 0);
            outcomes.push(outcome);
            match outcome {
                FailureOutcome::Retry { attempts: a, .. } => attempts = a,
                FailureOutcome::Dead { .. } => break,
            }
        }
        assert_eq!(
            outcomes,
            vec![
                FailureOutcome::Retry { attempts: 1, can_run_after: SECOND },
                FailureOutcome::Retry { attempts: 2, can_run_after: 2 * SECOND },
                FailureOutcome::Retry { attempts: 3, can_run_after: 4 * SECOND },
                FailureOutcome::Dead { attempts: 4 },
            ]
        );
    }

    #[test]
    fn permanent_and_override() {
        assert_eq!(fail(&B, 3, 0, true, None, 0), FailureOutcome::Dead { attempts: 1 });
        assert_eq!(fail(&B, 0, 0, false, None, 0), FailureOutcome::Dead { attempts: 1 });
        assert_eq!(fail(&B, 3, 0, false, Some(0), 7), FailureOutcome::Retry { attempts: 1, can_run_after: 7 });
    }
}

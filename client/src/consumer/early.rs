//! When the claim loop sends a claim before the rows of the one before it have run (src/consumer/
//! runner.rs, `send_ahead`): after a full claim, unless claims sent so came back without paying
//! for themselves, and then less and less often.

/// Whether a full claim of ordered or exclusive work sends the next claim before its rows run.
/// That claim can find work only in lanes no claim holds (this claim's stay held until its rows
/// have outcomes): where there are none (a stream of one lane, as many consumers as lanes) it
/// comes back empty, and costs the server a claim for nothing. So after one came back empty the
/// next such claims send none, one the first time, then twice as many each time (up to `MAX`),
/// until one sent finds work again. The claim loop keeps a second one for claims sent ahead of
/// parallel rows, whose miss is a claim that came back short (`landed`).
#[derive(Debug, Default)]
pub(super) struct Early {
    /// Full claims still to send none.
    skip: u32,
    /// How many to skip after the next miss.
    next: u32,
}

impl Early {
    const MAX: u32 = 64;

    /// Whether this full claim sends one.
    pub(super) fn due(&mut self) -> bool {
        if self.skip == 0 {
            return true;
        }
        self.skip -= 1;
        false
    }

    /// What the last claim sent early found.
    pub(super) fn found(&mut self, work: bool) {
        if work {
            self.next = 0;
        } else {
            self.next = (self.next * 2).clamp(1, Self::MAX);
            self.skip = self.next;
        }
    }
}

/// The two `Early`s of the claim loop: for claims sent before ordered or exclusive rows ran, and
/// for claims sent ahead of parallel ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    Early,
    Backlog,
}

/// Whether a claim that `gate` sent paid, having come back with `rows` of the `asked`: one sent
/// before ordered or exclusive rows ran if it found any (it took lanes those rows do not hold);
/// one sent ahead of parallel rows if it came back full.
pub(super) fn paid(gate: Gate, rows: usize, asked: usize) -> bool {
    match gate {
        Gate::Early => rows > 0,
        Gate::Backlog => rows == asked,
    }
}

#[cfg(test)]
mod tests {
    use super::{paid, Early, Gate};

    #[test]
    fn a_claim_sent_ahead_of_parallel_rows_pays_only_when_full() {
        assert!(paid(Gate::Backlog, 100, 100));
        // Short: the producers set the pace, and the next full claims send none (for a while).
        assert!(!paid(Gate::Backlog, 60, 100));
        assert!(!paid(Gate::Backlog, 0, 100));
        // Sent before ordered or exclusive rows ran: any work found pays.
        assert!(paid(Gate::Early, 1, 100));
        assert!(!paid(Gate::Early, 0, 100));
    }

    /// Which of `n` full claims send one early, `found` saying what each one sent found.
    fn sends(early: &mut Early, n: usize, found: bool) -> Vec<bool> {
        (0..n)
            .map(|_| {
                let due = early.due();
                if due {
                    early.found(found);
                }
                due
            })
            .collect()
    }

    #[test]
    fn claims_sent_early_back_off_while_they_find_nothing() {
        let mut early = Early::default();
        let (t, f) = (true, false);
        assert_eq!(sends(&mut early, 3, true), [t, t, t]);
        // Misses skip one claim, then two, then four.
        assert_eq!(sends(&mut early, 11, false), [t, f, t, f, f, t, f, f, f, f, t]);
        // A claim sent early that finds work again resets the pause.
        assert_eq!(sends(&mut early, 8, true), [f; 8]);
        assert_eq!(sends(&mut early, 2, true), [t, t]);
        assert_eq!(sends(&mut early, 3, false), [t, f, t]);
    }

    #[test]
    fn the_pause_is_bounded() {
        let mut early = Early::default();
        let sent = sends(&mut early, 1000, false).iter().filter(|&&s| s).count();
        // Seven sent while the pause grows to 64 (after 1 + 2 + ... + 32 = 63 skipped, at the
        // 70th claim), then one in every 65: 14 more.
        assert_eq!(sent, 21);
    }
}

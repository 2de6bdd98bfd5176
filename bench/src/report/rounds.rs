//! Every round of a workload run in rounds (`stats::in_rounds`), so that a reader can check each
//! ratio on the page against the runs it came from.

use std::fmt::Write as _;

/// A measure of a run, by name, as the table shows it.
type Measure<'a, T> = (&'a str, fn(&T) -> String);

/// Every round of every case, in run order: one row per case and measure, one column per round.
pub fn rounds_table<T>(cases: &[Vec<T>], case: impl Fn(&T) -> String, measures: &[Measure<'_, T>]) -> String {
    let rounds = cases.iter().map(Vec::len).max().unwrap_or(0);
    if rounds < 2 {
        return String::new();
    }
    let mut t = String::from("| case | measure |");
    for round in 1..=rounds {
        let _ = write!(t, " round {round}{} |", if round % 2 == 0 { " (reversed)" } else { "" });
    }
    let _ = writeln!(t, "\n|---|---|{}", "---|".repeat(rounds));
    for runs in cases.iter().filter(|r| !r.is_empty()) {
        for (measure, value) in measures {
            let _ = write!(t, "| {} | {measure} |", case(&runs[0]));
            for run in runs {
                let _ = write!(t, " {} |", value(run));
            }
            t.push('\n');
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rounds_table_has_a_row_per_case_and_measure_and_a_column_per_round() {
        let cases = vec![vec![(1, 10.0), (1, 11.0), (1, 12.0)], vec![(2, 20.0), (2, 21.0), (2, 22.0)]];
        let t = rounds_table(&cases, |c| format!("case {}", c.0), &[("rate", |c: &(i32, f64)| format!("{:.0}", c.1))]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| case | measure | round 1 | round 2 (reversed) | round 3 |");
        assert_eq!(lines[2], "| case 1 | rate | 10 | 11 | 12 |");
        assert_eq!(lines[3], "| case 2 | rate | 20 | 21 | 22 |");
        assert_eq!(lines.len(), 4);
        // One round has nothing to compare.
        assert_eq!(rounds_table(&[vec![(1, 1.0)]], |c| c.0.to_string(), &[]), "");
    }
}

//! The console's pages, as HTML that needs no script: maud escapes every value it puts in them
//! (payloads, errors, names), and every change is a form posted with the console's CSRF token.

use maud::{html, Markup, DOCTYPE};

use super::actions::{Action, Preview};
use super::link;
use super::rates::{chart, Rates};
use super::view::{Blocked, Dead, Status};

/// Everything a page may show besides its content.
pub struct Frame<'a> {
    pub title: String,
    /// The CSRF token the page's forms post.
    pub csrf: &'a str,
    /// What the role may do: buttons only where it may act (`None`: not known, on an error page).
    pub may_act: Option<bool>,
}

pub fn layout(frame: &Frame<'_>, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (frame.title) " · sqlstreams" }
                link rel="stylesheet" href="/style.css";
            }
            body {
                header {
                    a href="/" { "sqlstreams" }
                    @if frame.may_act == Some(false) {
                        span.readonly id="read-only" {
                            "read only: this role may inspect, but only superusers and members of sqlstreams_admin change groups"
                        }
                    }
                }
                main { (content) }
            }
        }
    }
}

fn age(seconds: Option<f64>) -> String {
    let Some(s) = seconds else { return "—".into() };
    let s = s.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86_400, s % 86_400 / 3600),
    }
}

fn state(status: &Status) -> Markup {
    html! { @if status.paused { span.paused { "paused" } } @else { span.active { "active" } } }
}

/// `/`: every stream's groups with their lag, backlog age and rates.
pub fn overview(frame: &Frame<'_>, groups: &[Status], rates: &Rates) -> Markup {
    layout(
        frame,
        html! {
            h1 { "Streams and groups" }
            @if groups.is_empty() {
                p { "No group this role may inspect." }
            } @else {
                table id="groups" {
                    thead { tr {
                        th { "stream" } th { "group" } th { "state" } th { "lag" } th { "oldest unresolved" }
                        th { "ready" } th { "in flight" } th { "deferred" } th { "dead" } th { "resolved / produced per second" }
                    } }
                    tbody {
                        @for g in groups {
                            @let (resolved, produced) = rates.per_second(&g.stream, &g.group);
                            tr.group data-stream=(g.stream) data-group=(g.group) {
                                td { (g.stream) }
                                td { a href=(link("/group", &g.stream, &g.group)) { (g.group) } }
                                td { (state(g)) }
                                td.lag { (g.lag) }
                                td { (age(g.oldest_age)) }
                                td { (g.ready) } td { (g.inflight) } td { (g.deferred) }
                                td.dead { (g.dead) }
                                td { (chart(&resolved, &produced)) }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// A form that posts `action` for the group, to `to` (`/preview` or `/apply`).
fn action_form(frame: &Frame<'_>, status: &Status, to: &str, action: &Action, label: &str) -> Markup {
    html! {
        form method="post" action=(to) class=(format!("action {}", action.fields()[0].1)) {
            input type="hidden" name="csrf" value=(frame.csrf);
            input type="hidden" name="stream" value=(status.stream);
            input type="hidden" name="group" value=(status.group);
            @for (name, value) in action.fields() {
                input type="hidden" name=(name) value=(value);
            }
            button type="submit" { (label) }
        }
    }
}

fn group_fields(frame: &Frame<'_>, status: &Status, action: &str) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(frame.csrf);
        input type="hidden" name="stream" value=(status.stream);
        input type="hidden" name="group" value=(status.group);
        input type="hidden" name="action" value=(action);
    }
}

fn status_table(status: &Status) -> Markup {
    html! {
        table.status {
            tr { th { "state" } td id="state" { (state(status)) } }
            tr { th { "concurrency" } td { (status.concurrency_override.as_deref().unwrap_or("as produced")) } }
            tr { th { "on dead" } td { (status.on_dead) } }
            tr { th { "head" } td { (status.head) } }
            tr { th { "claimed" } td { (status.claimed) } }
            tr { th { "committed" } td { (status.committed) } }
            tr { th { "lag" } td id="lag" { (status.lag) } }
            tr { th { "oldest unresolved" } td { (age(status.oldest_age)) } }
            tr { th { "open ranges" } td { (status.open_ranges) } }
            tr { th { "ready / in flight / deferred" } td { (status.ready) " / " (status.inflight) " / " (status.deferred) } }
            tr { th { "dead" } td id="dead" { (status.dead) } }
        }
    }
}

fn blocked_table(blocked: &[Blocked], buttons: impl Fn(&Blocked) -> Markup) -> Markup {
    html! {
        @if blocked.is_empty() {
            p.none { "No key is waiting." }
        } @else {
            table id="blocked" {
                thead { tr {
                    th { "key" } th { "held by message" } th { "status" } th { "attempts" } th { "may run after" }
                    th { "last error" } th { "waiting behind it" } th {}
                } }
                tbody {
                    @for b in blocked {
                        tr.blocked data-key=(b.key.as_deref().unwrap_or("")) data-id=(b.message_id) {
                            td { (b.key.as_deref().unwrap_or("(no key)")) }
                            td.id { (b.message_id) }
                            td.status { (b.status) }
                            td { (b.attempts) }
                            td { (b.can_run_after.as_deref().unwrap_or("")) }
                            td.error { pre { (b.last_error.as_deref().unwrap_or("")) } }
                            td.behind { (b.waiting_behind) }
                            td { (buttons(b)) }
                        }
                    }
                }
            }
        }
    }
}

/// `/group`: one group, why its keys wait, its dead letters, and what the role may do.
pub fn group(
    frame: &Frame<'_>,
    status: &Status,
    blocked: &[Blocked],
    dead: &[Dead],
    rates: &Rates,
    notice: Option<&str>,
) -> Markup {
    let (resolved, produced) = rates.per_second(&status.stream, &status.group);
    layout(
        frame,
        html! {
            h1 { (status.stream) " / " (status.group) }
            @if let Some(notice) = notice { p.notice id="notice" { "Done: " (notice) "." } }
            (status_table(status))
            p { "resolved / produced per second: " (chart(&resolved, &produced)) }
            @if frame.may_act == Some(true) {
                @if status.paused {
                    (action_form(frame, status, "/apply", &Action::Resume, "Resume"))
                } @else {
                    (action_form(frame, status, "/apply", &Action::Pause, "Pause"))
                }
            }

            h2 { "Blocked keys" }
            p.help { "Each key's oldest unresolved message holds the messages of that key behind it." }
            (blocked_table(blocked, |b| html! {
                @if frame.may_act == Some(true) && b.status == "dead" {
                    (action_form(frame, status, "/preview", &Action::Redrive(Some(vec![b.message_id])), "Redrive…"))
                    (action_form(frame, status, "/preview", &Action::Skip(b.message_id), "Skip…"))
                }
            }))

            h2 { "Dead letters" }
            @if dead.is_empty() {
                p.none { "No dead letters." }
            } @else {
                table id="dead-letters" {
                    thead { tr {
                        th { "message" } th { "key" } th { "attempts" } th { "died at" } th { "last error" } th { "payload" } th {}
                    } }
                    tbody {
                        @for d in dead {
                            tr.dead-letter data-id=(d.id) {
                                td.id { (d.id) }
                                td { (d.key.as_deref().unwrap_or("")) }
                                td { (d.attempts) }
                                td { (d.died_at.as_deref().unwrap_or("")) }
                                td.error { pre { (d.last_error.as_deref().unwrap_or("")) } }
                                td.payload { pre { (d.payload) } }
                                td {
                                    @if frame.may_act == Some(true) {
                                        (action_form(frame, status, "/preview", &Action::Redrive(Some(vec![d.id])), "Redrive…"))
                                        (action_form(frame, status, "/preview", &Action::Skip(d.id), "Skip…"))
                                    }
                                }
                            }
                        }
                    }
                }
                @if frame.may_act == Some(true) {
                    (action_form(frame, status, "/preview", &Action::Redrive(None), "Redrive every dead letter…"))
                    form method="post" action="/preview" class="action purge" {
                        (group_fields(frame, status, "purge"))
                        label { "Purge dead letters older than " input type="text" name="older_than" value="7 days" required; }
                        button type="submit" { "Purge…" }
                    }
                }
            }

            @if frame.may_act == Some(true) {
                h2 { "Seek" }
                form method="post" action="/preview" class="action seek" {
                    (group_fields(frame, status, "seek"))
                    label { "Move the group to position " input type="number" name="to_id" min="0" required; }
                    label { input type="checkbox" name="force"; " although consumers hold open leases" }
                    button type="submit" { "Seek…" }
                }
                p.help { "Back replays the messages after the position; forward skips them. Shown before it is made." }
            }
        },
    )
}

/// `/preview`: what an action would change, read in a transaction that was rolled back, and the
/// form that makes it (the action as the preview pinned it).
pub fn preview(frame: &Frame<'_>, status: &Status, action: &Action, preview: &Preview) -> Markup {
    let rows: [(&str, i64, i64); 6] = [
        ("claimed", preview.before.claimed, preview.after.claimed),
        ("committed", preview.before.committed, preview.after.committed),
        ("lag", preview.before.lag, preview.after.lag),
        ("ready", preview.before.ready, preview.after.ready),
        ("deferred", preview.before.deferred, preview.after.deferred),
        ("dead", preview.before.dead, preview.after.dead),
    ];
    // Keys whose holding message changes, by that message; and keys that no longer wait.
    let changed: Vec<&Blocked> =
        preview.blocked_after.iter().filter(|after| !preview.blocked_before.contains(after)).collect();
    let released: Vec<&Blocked> = preview
        .blocked_before
        .iter()
        .filter(|before| !preview.blocked_after.iter().any(|after| after.key == before.key))
        .collect();
    layout(
        frame,
        html! {
            h1 { "Preview: " (action.describe()) }
            p.notice id="preview-outcome" { "Nothing has changed yet. Confirmed: " (preview.outcome) "." }
            p.help {
                "Read before and after the change in one transaction that was rolled back; what other "
                "consumers did meanwhile shows too."
            }
            table.compare id="compare" {
                thead { tr { th {} th { "now" } th { "after" } } }
                tbody {
                    @for (name, before, after) in rows {
                        tr class=(if before != after { "changes" } else { "same" }) {
                            th { (name) } td { (before) } td { (after) }
                        }
                    }
                }
            }
            h2 { "Keys it changes" }
            p.help { "Each key's messages run in order, from the one that holds it." }
            @if changed.is_empty() && released.is_empty() {
                p.none { "No waiting key changes." }
            } @else {
                ul id="released-keys" {
                    @for b in &changed {
                        li.changes data-key=(b.key.as_deref().unwrap_or("")) {
                            "key " strong { (b.key.as_deref().unwrap_or("(no key)")) } ": message " (b.message_id)
                            " becomes " em { (b.status) }
                            @if b.waiting_behind > 0 { ", then the " (b.waiting_behind) " message(s) behind it" }
                        }
                    }
                    @for b in &released {
                        li.released data-key=(b.key.as_deref().unwrap_or("")) {
                            "key " strong { (b.key.as_deref().unwrap_or("(no key)")) } ": no longer waits"
                        }
                    }
                }
            }
            form method="post" action="/apply" class="confirm" {
                input type="hidden" name="csrf" value=(frame.csrf);
                input type="hidden" name="stream" value=(status.stream);
                input type="hidden" name="group" value=(status.group);
                @for (name, value) in preview.confirm.fields() {
                    input type="hidden" name=(name) value=(value);
                }
                button type="submit" id="confirm" { "Confirm: " (preview.confirm.describe()) }
                " "
                a href=(link("/group", &status.stream, &status.group)) id="cancel" { "Cancel" }
            }
        },
    )
}

/// A refusal or a database error, with what to do.
pub fn error(frame: &Frame<'_>, message: &str, back: Option<String>) -> Markup {
    layout(
        frame,
        html! {
            h1 { "Not done" }
            p.error id="error" { (message) }
            @if let Some(back) = back { p { a href=(back) { "Back to the group" } } }
        },
    )
}

pub const STYLE: &str = "\
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #222; }
header { background: #234; padding: 8px 16px; }
header a { color: #fff; font-weight: bold; text-decoration: none; }
header .readonly { color: #fc6; margin-left: 16px; }
main { padding: 8px 16px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
td pre { margin: 0; max-width: 40em; white-space: pre-wrap; }
.paused { color: #b60; font-weight: bold; }
.active { color: #2a6; }
.notice { background: #eef6ee; padding: 6px 10px; }
.error { background: #fbeaea; padding: 6px 10px; }
.help, .none { color: #666; }
form.action { display: inline-block; margin: 2px 4px 2px 0; }
tr.changes td { font-weight: bold; }
.chart { vertical-align: middle; }
.rate { margin-left: 6px; }
";

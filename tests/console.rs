//! The web console (`sqlstreams console`, client/src/bin/sqlstreams/console/) in a real browser:
//! Debian's headless Chromium driven through its ChromeDriver (WebDriver), as an operator uses
//! it; and its refusals, asked for with plain HTTP requests no browser would send.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client as Browser, ClientBuilder, Locator};
use sqlstreams_tests::*;

/// The token the tests' consoles run with.
const TOKEN: &str = "test-token-0123456789abcdef";

/// A console process, stopped when dropped.
struct Console {
    child: Child,
    address: String,
}

impl Console {
    /// Starts `sqlstreams console` as `url`'s role on a free loopback port with `args` (after
    /// `console`), with `TOKEN`; returns once it listens.
    fn start(url: &str, args: &[&str]) -> Console {
        Console::start_with(url, &["--listen", "127.0.0.1:0"], args, Some(TOKEN)).0
    }

    /// Starts it with `listen` and `args`, and `token` in SQLSTREAMS_CONSOLE_TOKEN (none: it
    /// makes one); returns it, and the line after the address, if any.
    fn start_with(url: &str, listen: &[&str], args: &[&str], token: Option<&str>) -> (Console, String) {
        let mut command = console_command(url);
        command.args(listen).args(["--sample-every", "1"]).args(args).stderr(Stdio::piped());
        match token {
            Some(token) => command.env("SQLSTREAMS_CONSOLE_TOKEN", token),
            None => command.env_remove("SQLSTREAMS_CONSOLE_TOKEN"),
        };
        let mut child = command.spawn().expect("start the console");
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        let address = line
            .trim()
            .strip_prefix("sqlstreams console: listening on http://")
            .and_then(|rest| rest.strip_suffix('/'))
            .unwrap_or_else(|| panic!("the console did not start: {line}"))
            .to_string();
        let mut next = String::new();
        if token.is_none() {
            stderr.read_line(&mut next).unwrap();
        }
        (Console { child, address }, next.trim().to_string())
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }
}

/// `sqlstreams --dsn url console`, without a terminal.
fn console_command(url: &str) -> Command {
    let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
    let mut command = Command::new(bin);
    command.args(["--dsn", url, "console"]).stdin(Stdio::null()).stdout(Stdio::null());
    command
}

/// The test cluster's URL for `role`.
fn url_as(role: &str) -> String {
    let base = database_url();
    match base.split_once("://").and_then(|(_, rest)| rest.split_once('@')) {
        Some((_, host)) => format!("postgres://{role}@{host}"),
        None => panic!("DATABASE_URL names a user: {base}"),
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const BEARER: &str = "Authorization: Bearer test-token-0123456789abcdef\r\n";

/// An HTTP/1.1 exchange with the console: `request` is everything before the body. Returns the
/// status code, the headers (lower-cased names) and the body.
fn http(address: &str, request: &str, body: &str) -> (u16, Vec<(String, String)>, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let length = if body.is_empty() { String::new() } else { format!("Content-Length: {}\r\n", body.len()) };
    let request = request.trim_end_matches("\r\n");
    write!(stream, "{request}\r\n{length}Connection: close\r\n\r\n{body}").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let mut lines = head.lines();
    let status = lines.next().unwrap_or("").split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

fn get(address: &str, path: &str, extra: &str) -> (u16, Vec<(String, String)>, String) {
    http(address, &format!("GET {path} HTTP/1.1\r\nHost: {address}\r\n{extra}"), "")
}

fn post(address: &str, path: &str, extra: &str, form: &str) -> u16 {
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/x-www-form-urlencoded\r\n{extra}"
    );
    http(address, &request, form).0
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// The CSRF token in a page's forms.
fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a form with the CSRF token") + 19;
    page[at..at + 64].to_string()
}

/// Headless Chromium through ChromeDriver, both stopped when dropped.
struct Chromium {
    driver: Child,
    browser: Option<Browser>,
    runtime: tokio::runtime::Runtime,
    _profile: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Chromium {
    fn start() -> Chromium {
        let driver_bin = std::env::var("SQLSTREAMS_CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("run {driver_bin} (Debian's chromium-driver; scripts/rig installs it): {e}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = TempDir(std::env::temp_dir().join(unique("sqlstreams-chromium")));
        // As root, without the sandbox; without the background traffic this closed network refuses.
        let profile_dir = format!("--user-data-dir={}", profile.0.display());
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
            "--no-first-run",
            &profile_dir,
        ];
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), json!({ "binary": "/usr/bin/chromium", "args": args }));
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let browser = runtime
            .block_on(
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(capabilities)
                    .connect(&format!("http://127.0.0.1:{port}")),
            )
            .expect("start headless Chromium");
        Chromium { driver, browser: Some(browser), runtime, _profile: profile }
    }

    fn browser(&self) -> &Browser {
        self.browser.as_ref().unwrap()
    }

    fn goto(&self, url: &str) {
        self.runtime.block_on(self.browser().goto(url)).unwrap();
    }

    /// The text of the first element `css` selects.
    /// The text of the first element `css` selects, once the page has one (a click's page may
    /// still be on its way).
    fn text(&self, css: &str) -> String {
        self.runtime
            .block_on(async {
                let wait = self.browser().wait().at_most(Duration::from_secs(30));
                wait.for_element(Locator::Css(css)).await?.text().await
            })
            .unwrap_or_else(|e| panic!("{css}: {e}; the page shows: {}", self.shown()))
    }

    /// What the page shows, for a failure's message.
    fn shown(&self) -> String {
        self.runtime
            .block_on(async { self.browser().find(Locator::Css("body")).await?.text().await })
            .unwrap_or_else(|e| e.to_string())
    }

    fn count(&self, css: &str) -> usize {
        self.runtime.block_on(self.browser().find_all(Locator::Css(css))).unwrap().len()
    }

    fn click(&self, css: &str) {
        self.runtime
            .block_on(async { self.browser().find(Locator::Css(css)).await?.click().await })
            .unwrap_or_else(|e| panic!("click {css}: {e}; the page shows: {}", self.shown()));
    }

    fn type_into(&self, css: &str, text: &str) {
        self.runtime
            .block_on(async { self.browser().find(Locator::Css(css)).await?.send_keys(text).await })
            .unwrap_or_else(|e| panic!("type into {css}: {e}; the page shows: {}", self.shown()));
    }

    /// Waits until the browser shows `path` (a click's navigation ends after the click returns).
    fn at(&self, path: &str) {
        self.until(&format!("the browser shows {path}"), || {
            self.runtime.block_on(self.browser().current_url()).unwrap().path() == path
        });
    }

    /// Waits until the first element `css` selects reads `text`.
    fn reads(&self, css: &str, text: &str) {
        self.until(&format!("{css} reads {text:?}"), || {
            self.runtime
                .block_on(async { self.browser().find(Locator::Css(css)).await?.text().await })
                .is_ok_and(|t| t == text)
        });
    }

    fn until(&self, what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "never: {what}; the page shows: {}", self.shown());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn source(&self) -> String {
        self.runtime.block_on(self.browser().source()).unwrap()
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        if let Some(browser) = self.browser.take() {
            let _ = self.runtime.block_on(browser.close());
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// An ordered group that holds a key on a dead message: `acct-1`'s first message failed for
/// good, and its other two wait behind it. Returns the group and the three ids.
fn a_held_key(c: &mut postgres::Client, error: &str) -> (Group, [i64; 3]) {
    let s = Stream::create(c, "console");
    let g = s.group_with(c, "billing", Some("ordered"), 0);
    c.execute("SELECT sqlstreams.alter_group($1, 'billing', on_dead => 'hold')", &[&s.name]).unwrap();
    let produced = [0, 1, 2].map(|n| s.produce(c, json!({ "n": n }), Some("acct-1")));
    let first = g.claim(c, 1);
    assert_eq!(ids(&first), vec![produced[0]]);
    assert_eq!(g.fail(c, &first[0], error, true, None).as_deref(), Some("dead"));
    assert!(g.claim(c, 10).is_empty(), "the key is held on its dead message");
    (g, produced)
}

fn dead_letters(c: &mut postgres::Client, g: &Group) -> i64 {
    c.query_one("SELECT count(*) FROM sqlstreams.dead_messages($1, $2)", &[&g.stream.name, &g.name]).unwrap().get(0)
}

#[test]
fn a_redrive_in_the_browser_releases_a_held_ordered_key_in_order() {
    let mut c = connect();
    let error = "card <script>document.title='owned'</script> declined";
    let (g, held) = a_held_key(&mut c, error);
    let console = Console::start(&database_url(), &[]);
    let chromium = Chromium::start();

    // Without its token the console shows nothing; opening /?token=... once lets the browser in.
    chromium.goto(&console.url("/"));
    assert!(chromium.text("body").contains("needs its token"));
    chromium.goto(&console.url(&format!("/?token={TOKEN}")));
    chromium.at("/");

    // The overview: the group with its dead letter, and a link to it.
    let row = format!("tr.group[data-stream='{}'][data-group='billing']", g.stream.name);
    assert_eq!(chromium.text(&format!("{row} td.dead")), "1");
    assert_eq!(chromium.text(&format!("{row} td.lag")), "2", "the dead message counts as resolved");
    chromium.click(&format!("{row} a"));
    chromium.at("/group");

    // Why the key is stuck: its dead message, with the error as text (not as markup).
    let key = "tr.blocked[data-key='acct-1']";
    assert_eq!(chromium.text(&format!("{key} td.id")), held[0].to_string());
    assert_eq!(chromium.text(&format!("{key} td.status")), "dead");
    assert_eq!(chromium.text(&format!("{key} td.error")), error);
    assert!(chromium.source().contains("&lt;script&gt;"), "the error is escaped");
    assert!(chromium.text("tr.dead-letter td.payload").contains("\"n\": 0"), "the dead letter's payload");

    // A redrive is shown first, and nothing changes until it is confirmed.
    chromium.click(&format!("{key} form.redrive button"));
    chromium.at("/preview");
    assert!(chromium.text("#preview-outcome").contains(&format!("1 message(s) redriven: {}", held[0])));
    let released = chromium.text("#released-keys li[data-key='acct-1']");
    assert!(released.contains(&format!("message {} becomes ready", held[0])), "{released}");
    assert_eq!(dead_letters(&mut c, &g), 1, "the preview changed nothing");
    chromium.click("#confirm");
    chromium.at("/group");
    assert!(chromium.text("#notice").contains("redriven"));
    assert_eq!(chromium.text(&format!("{key} td.status")), "ready");

    // The key runs again, in order.
    let mut delivered = Vec::new();
    for _ in 0..3 {
        let batch = g.claim(&mut c, 1);
        assert_eq!(batch.len(), 1, "one message of the key at a time, after {delivered:?}");
        assert!(g.ack(&mut c, &batch[0]));
        delivered.push(batch[0].message_id);
    }
    assert_eq!(delivered, held, "the redriven message first, then the two behind it");

    // Pause and resume are buttons of their own.
    chromium.goto(&console.url(&format!("/group?stream={}&group=billing", g.stream.name)));
    chromium.click("form.pause button");
    chromium.reads("#state", "paused");
    chromium.click("form.resume button");
    chromium.reads("#state", "active");

    // A seek back is shown with what it would replay, and cancelled changes nothing.
    chromium.type_into("form.seek input[name='to_id']", "0");
    chromium.click("form.seek button");
    chromium.at("/preview");
    assert!(chromium.text("#preview-outcome").contains("position 0"));
    assert_eq!(chromium.text("#compare tr.changes th"), "claimed", "the first count it moves");
    chromium.click("#cancel");
    chromium.at("/group");
    assert!(g.claim(&mut c, 10).is_empty(), "no replay: the seek was not made");
}

#[test]
fn a_confirmation_makes_what_the_preview_showed() {
    let mut c = connect();
    let (g, held) = a_held_key(&mut c, "declined");
    let console = Console::start(&database_url(), &[]);
    let address = console.address.clone();
    let (_, _, page) = get(&address, &format!("/group?stream={}&group=billing", g.stream.name), BEARER);
    let csrf = csrf_of(&page);
    // "Redrive every dead letter" is previewed: it would redrive the one there is.
    let form = format!("csrf={csrf}&stream={}&group=billing&action=redrive&ids=", g.stream.name);
    let request = format!(
        "POST /preview HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/x-www-form-urlencoded\r\n{BEARER}"
    );
    let (status, _, preview) = http(&address, &request, &form);
    assert_eq!(status, 200, "{preview}");
    assert!(preview.contains(&format!("name=\"ids\" value=\"{}\"", held[0])), "the confirmation names it");

    // Another letter dies meanwhile: the confirmation redrives only what the preview showed.
    let s = g.stream.clone();
    let later = s.produce(&mut c, json!({}), Some("acct-2"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![later]);
    assert_eq!(g.fail(&mut c, &batch[0], "declined too", true, None).as_deref(), Some("dead"));
    let confirm = format!("csrf={csrf}&stream={}&group=billing&action=redrive&ids={}", g.stream.name, held[0]);
    assert_eq!(post(&address, "/apply", BEARER, &confirm), 303);
    let dead: Vec<i64> = c
        .query("SELECT message_id FROM sqlstreams.dead_messages($1, 'billing')", &[&g.stream.name])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dead, vec![later], "the letter that died after the preview is still dead");
}

#[test]
fn a_monitoring_role_sees_everything_and_may_change_nothing() {
    let mut c = connect();
    let (g, held) = a_held_key(&mut c, "declined");
    let monitor = role(&mut c, "console_monitor", "IN ROLE pg_monitor");
    let console = Console::start(&url_as(&monitor), &[]);
    let chromium = Chromium::start();
    chromium.goto(&console.url(&format!("/?token={TOKEN}")));
    chromium.at("/");
    chromium.goto(&console.url(&format!("/group?stream={}&group=billing", g.stream.name)));
    assert!(chromium.text("#read-only").contains("read only"));
    assert_eq!(chromium.text("tr.blocked[data-key='acct-1'] td.id"), held[0].to_string(), "it sees why the key waits");
    assert_eq!(chromium.count("tr.dead-letter"), 1, "and the dead letter");
    assert_eq!(chromium.count("button"), 0, "no change is offered");
    assert_eq!(chromium.count("input[name='csrf']"), 0);

    // An admin's console whose role loses sqlstreams_admin refuses the change itself, with a
    // form from its own page (the CSRF token is right).
    let admin = role(&mut c, "console_admin", "IN ROLE sqlstreams_admin");
    let console = Console::start(&url_as(&admin), &[]);
    let (_, _, page) = get(&console.address, &format!("/group?stream={}&group=billing", g.stream.name), BEARER);
    let csrf = csrf_of(&page);
    c.batch_execute(&format!("REVOKE sqlstreams_admin FROM {admin}")).unwrap();
    let form = format!("csrf={csrf}&stream={}&group=billing&action=redrive&ids={}", g.stream.name, held[0]);
    let request = format!(
        "POST /apply HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\n{BEARER}",
        console.address
    );
    let (status, _, body) = http(&console.address, &request, &form);
    assert_eq!(status, 403);
    assert!(body.contains("may not change groups"), "{body}");
    assert_eq!(dead_letters(&mut c, &g), 1);
}

#[test]
fn requests_from_elsewhere_are_refused() {
    let mut c = connect();
    let (g, held) = a_held_key(&mut c, "declined");
    let console = Console::start(&database_url(), &[]);
    let address = console.address.clone();
    let group_page = format!("/group?stream={}&group=billing", g.stream.name);
    let (status, headers, page) = get(&address, &group_page, BEARER);
    assert_eq!(status, 200);
    let csp = header(&headers, "content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(header(&headers, "x-frame-options"), Some("DENY"));
    let csrf = csrf_of(&page);
    let form =
        |csrf: &str| format!("csrf={csrf}&stream={}&group=billing&action=redrive&ids={}", g.stream.name, held[0]);
    let from = |origin: &str| format!("{BEARER}Origin: {origin}\r\n");

    // A page of another site posting to the console: another origin, a sandboxed one, or no
    // CSRF token, a wrong one.
    assert_eq!(post(&address, "/apply", &from("http://attacker.example"), &form(&csrf)), 403);
    assert_eq!(post(&address, "/apply", &from("null"), &form(&csrf)), 403);
    assert_eq!(post(&address, "/apply", &format!("{BEARER}Sec-Fetch-Site: cross-site\r\n"), &form(&csrf)), 403);
    assert_eq!(post(&address, "/apply", BEARER, &form(&"0".repeat(64))), 403);
    let without = format!("stream={}&group=billing&action=redrive&ids={}", g.stream.name, held[0]);
    assert_eq!(post(&address, "/apply", BEARER, &without), 403);
    // A name that resolves to the console's address (DNS rebinding) is not the console's host.
    let (status, _, _) = http(&address, &format!("GET / HTTP/1.1\r\nHost: attacker.example:80\r\n{BEARER}"), "");
    assert_eq!(status, 421);
    assert_eq!(dead_letters(&mut c, &g), 1, "nothing was redriven");
    // The console's own form, from its own origin (through a TLS proxy: https), is made.
    assert_eq!(post(&address, "/apply", &from(&format!("https://{address}")), &form(&csrf)), 303);
    assert_eq!(g.claim(&mut c, 10).len(), 1, "the redriven message runs");
}

#[test]
fn every_request_needs_the_token() {
    // Without one given, it makes one and says where to open it.
    let (console, line) = Console::start_with(&database_url(), &["--listen", "127.0.0.1:0"], &[], None);
    let made = line.rsplit_once("?token=").map(|(_, rest)| rest.split_whitespace().next().unwrap().to_string());
    let made = made.unwrap_or_else(|| panic!("no token to open: {line}"));
    assert_eq!(get(&console.address, "/", "").0, 401);
    assert_eq!(get(&console.address, "/", &format!("Authorization: Bearer {made}\r\n")).0, 200);
    drop(console);

    // A short token, or a wildcard address without the names it is reached by, does not start.
    let refused = |listen: &str, token: &str| {
        let out = console_command(&database_url())
            .args(["--listen", listen])
            .env("SQLSTREAMS_CONSOLE_TOKEN", token)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(refused("127.0.0.1:0", "short").contains("at least 16 characters"));
    assert!(refused("0.0.0.0:0", TOKEN).contains("--allowed-host"));

    // On every address, reached by the name it was given.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("0.0.0.0:{port}");
    let reached = format!("127.0.0.1:{port}");
    let (console, _) =
        Console::start_with(&database_url(), &["--listen", &listen], &["--allowed-host", &reached], Some(TOKEN));
    let address = reached;
    assert_eq!(console.address, listen);
    assert_eq!(get(&address, "/", "").0, 401);
    assert_eq!(get(&address, "/", "Authorization: Bearer wrong-token-0123456789\r\n").0, 401);
    assert_eq!(get(&address, "/", BEARER).0, 200);
    // Opening /?token=... once trades it for a session cookie scripts cannot read, and leaves
    // the address for the front page.
    let (status, headers, _) = get(&address, &format!("//attacker.example/?token={TOKEN}"), "");
    assert_eq!(status, 303);
    assert_eq!(header(&headers, "location"), Some("/"));
    let cookie = header(&headers, "set-cookie").unwrap();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let pair = cookie.split(';').next().unwrap();
    assert!(!pair.contains(TOKEN), "the cookie is a session, not the token");
    assert_eq!(get(&address, "/", &format!("Cookie: {pair}\r\n")).0, 200);
    assert_eq!(get(&address, "/?token=wrong", "").0, 401);
}

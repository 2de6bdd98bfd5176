//! The web console (`sqlstreams console`, client/src/bin/sqlstreams/console/) in a real browser:
//! Debian's headless Chromium driven through its ChromeDriver (WebDriver), as an operator uses
//! it; and its refusals, asked for with plain HTTP requests no browser would send.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client as Browser, ClientBuilder, Locator};
use sqlstreams_tests::*;

/// A console process, stopped when dropped.
struct Console {
    child: Child,
    address: String,
}

impl Console {
    /// Starts `sqlstreams console` as `url`'s role with `args`; returns once it listens.
    fn start(url: &str, args: &[&str], env: &[(&str, &str)]) -> Console {
        let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
        let mut child = Command::new(bin)
            .args(["--dsn", url, "console", "--listen", "127.0.0.1:0", "--sample-every", "1"])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the console");
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        let address = line
            .trim()
            .strip_prefix("sqlstreams console: listening on http://")
            .and_then(|rest| rest.strip_suffix('/'))
            .unwrap_or_else(|| panic!("the console did not start: {line}"))
            .to_string();
        Console { child, address }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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

#[test]
fn a_redrive_in_the_browser_releases_a_held_ordered_key_in_order() {
    let mut c = connect();
    let error = "card <script>document.title='owned'</script> declined";
    let (g, held) = a_held_key(&mut c, error);
    let console = Console::start(&database_url(), &[], &[]);
    let chromium = Chromium::start();

    // The overview: the group with its dead letter, and a link to it.
    chromium.goto(&console.url("/"));
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

    // A redrive is shown first, and nothing changes until it is confirmed.
    chromium.click(&format!("{key} form.redrive button"));
    chromium.at("/preview");
    assert!(chromium.text("#preview-outcome").contains(&format!("1 message(s) redriven: {}", held[0])));
    assert!(chromium.text("#released-keys").contains("acct-1"), "the key it releases");
    let dead: i64 =
        c.query_one("SELECT count(*) FROM sqlstreams.dead_messages($1, 'billing')", &[&g.stream.name]).unwrap().get(0);
    assert_eq!(dead, 1, "the preview changed nothing");
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
}

#[test]
fn a_monitoring_role_sees_everything_and_may_change_nothing() {
    let mut c = connect();
    let (g, held) = a_held_key(&mut c, "declined");
    let monitor = role(&mut c, "console_monitor", "IN ROLE pg_monitor");
    let base = database_url();
    let url = match base.split_once("://").and_then(|(_, rest)| rest.split_once('@')) {
        Some((_, host)) => format!("postgres://{monitor}@{host}"),
        None => panic!("DATABASE_URL names a user: {base}"),
    };
    let console = Console::start(&url, &[], &[]);
    let chromium = Chromium::start();
    chromium.goto(&console.url(&format!("/group?stream={}&group=billing", g.stream.name)));
    assert!(chromium.text("#read-only").contains("read only"));
    assert_eq!(chromium.text("tr.blocked[data-key='acct-1'] td.id"), held[0].to_string(), "it sees why the key waits");
    assert_eq!(chromium.count("tr.dead-letter"), 1, "and the dead letter");
    assert_eq!(chromium.count("button"), 0, "no change is offered");
    assert_eq!(chromium.count("input[name='csrf']"), 0);
    // Posted anyway, without the console's token (its pages have none to give), it is refused.
    let form = format!("csrf=&stream={}&group=billing&action=redrive&id={}", g.stream.name, held[0]);
    assert_eq!(post(&console.address, "/apply", "", &form), 403);
    let dead: i64 =
        c.query_one("SELECT count(*) FROM sqlstreams.dead_messages($1, 'billing')", &[&g.stream.name]).unwrap().get(0);
    assert_eq!(dead, 1);
}

#[test]
fn requests_from_elsewhere_are_refused() {
    let mut c = connect();
    let (g, held) = a_held_key(&mut c, "declined");
    let console = Console::start(&database_url(), &[], &[]);
    let address = console.address.clone();
    let group_page = format!("/group?stream={}&group=billing", g.stream.name);
    let (status, headers, page) = get(&address, &group_page, "");
    assert_eq!(status, 200);
    let csp = header(&headers, "content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(header(&headers, "x-frame-options"), Some("DENY"));
    let csrf = csrf_of(&page);
    let form = |csrf: &str| format!("csrf={csrf}&stream={}&group=billing&action=redrive&id={}", g.stream.name, held[0]);

    // A page of another site posting to the console: another origin, or no token.
    assert_eq!(post(&address, "/apply", "Origin: http://attacker.example\r\n", &form(&csrf)), 403);
    assert_eq!(post(&address, "/apply", "Sec-Fetch-Site: cross-site\r\n", &form(&csrf)), 403);
    assert_eq!(post(&address, "/apply", "", &form("0".repeat(64).as_str())), 403);
    // A name that resolves to the console's address (DNS rebinding) is not the console's host.
    let (status, _, _) = http(&address, "GET / HTTP/1.1\r\nHost: attacker.example:80\r\n", "");
    assert_eq!(status, 421);
    let dead: i64 =
        c.query_one("SELECT count(*) FROM sqlstreams.dead_messages($1, 'billing')", &[&g.stream.name]).unwrap().get(0);
    assert_eq!(dead, 1, "nothing was redriven");
    // The console's own form, from its own origin, is made.
    assert_eq!(post(&address, "/apply", &format!("Origin: http://{address}\r\n"), &form(&csrf)), 303);
    assert_eq!(g.claim(&mut c, 10).len(), 1, "the redriven message runs");
}

#[test]
fn a_console_beyond_loopback_needs_its_token() {
    let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
    let out = Command::new(&bin)
        .args(["--dsn", &database_url(), "console", "--listen", "0.0.0.0:0"])
        .env_remove("SQLSTREAMS_CONSOLE_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("SQLSTREAMS_CONSOLE_TOKEN"));

    let token = "t0ken-for-the-test";
    let console = Console::start(&database_url(), &[], &[("SQLSTREAMS_CONSOLE_TOKEN", token)]);
    let address = console.address.clone();
    assert_eq!(get(&address, "/", "").0, 401);
    assert_eq!(get(&address, "/", "Authorization: Bearer wrong\r\n").0, 401);
    assert_eq!(get(&address, "/", &format!("Authorization: Bearer {token}\r\n")).0, 200);
    // Opening /?token=... once trades it for a cookie scripts cannot read, and leaves the address.
    let (status, headers, _) = get(&address, &format!("/?token={token}"), "");
    assert_eq!(status, 303);
    assert_eq!(header(&headers, "location"), Some("/"));
    let cookie = header(&headers, "set-cookie").unwrap();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let pair = cookie.split(';').next().unwrap();
    assert_eq!(get(&address, "/", &format!("Cookie: {pair}\r\n")).0, 200);
    assert_eq!(get(&address, "/?token=wrong", "").0, 401);
}

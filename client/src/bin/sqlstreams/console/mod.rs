//! `sqlstreams console`: a web console over the extension's SQL API (docs/console.md).
//!
//! It shows what the role it connects as may inspect, and offers a change only where that role
//! may make it; the database checks every call again. Redrive, skip, purge and seek are shown
//! in a rolled-back transaction before they are made (src/bin/sqlstreams/console/actions.rs).
//!
//! Who may reach it:
//! - every request carries its token (`SQLSTREAMS_CONSOLE_TOKEN`, or a new one printed at
//!   start): a session cookie set by opening `/?token=...` once, or `Authorization: Bearer`. A
//!   loopback address is no boundary on a machine several people use;
//! - it listens on a loopback address unless told otherwise;
//! - a request whose `Host` is not one the console is reached by is refused (a DNS-rebinding page
//!   would otherwise read it from the operator's browser);
//! - a change is a POST with the console's CSRF token (random per process, only in its own
//!   pages) from one of those origins (`Origin`, `Sec-Fetch-Site`); pages carry a strict content
//!   security policy, run no script and may not be framed.

mod actions;
mod pages;
mod rates;
mod view;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::Markup;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use actions::Action;
use pages::Frame;
use rates::Rates;
use view::{Blocked, Dead, Status};

/// How the console runs.
pub struct Options {
    pub listen: SocketAddr,
    pub token: Option<String>,
    /// More `host:port` values a request's `Host` may have (a name the console is reached by).
    pub allowed_hosts: Vec<String>,
    pub sample_every: Duration,
    pub statement_timeout: String,
}

struct Console {
    client: sqlstreams_client::Client,
    token: String,
    /// What the session cookie holds: random per process, never the token itself (a cookie goes
    /// to every port of its host).
    session: String,
    session_cookie: String,
    csrf: String,
    allowed_hosts: Vec<String>,
    statement_timeout: String,
    rates: Mutex<Rates>,
}

type Shared = Arc<Console>;

/// Serves the console until the process ends.
pub async fn serve(client: sqlstreams_client::Client, options: Options) -> Result<(), String> {
    let given = options.token.filter(|t| !t.is_empty());
    if let Some(token) = &given {
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_alphanumeric() || b"._~-".contains(&b)) {
            return Err("the console's token must be at least 16 characters of A-Z, a-z, 0-9 and ._~- \
                        (`openssl rand -hex 32` makes one)"
                .into());
        }
    }
    if options.allowed_hosts.iter().any(|h| h.trim().is_empty()) {
        return Err("--allowed-host needs a HOST or HOST:PORT".into());
    }
    if options.listen.ip().is_unspecified() && options.allowed_hosts.is_empty() {
        return Err(format!(
            "on {} the console is reached by names it cannot know: name each with --allowed-host \
             (HOST:PORT as browsers send it, or HOST behind a proxy on its default port)",
            options.listen
        ));
    }
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|e| format!("listen on {}: {e}", options.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let mut allowed_hosts = options.allowed_hosts;
    if !local.ip().is_unspecified() {
        allowed_hosts.push(local.to_string());
    }
    if local.ip().is_loopback() {
        allowed_hosts.push(format!("localhost:{}", local.port()));
    }
    // One cookie per console: browsers send a host's cookies to each of its ports.
    let session_cookie = format!("sqlstreams_console_{}", local.port());
    let console = Arc::new(Console {
        client,
        token: given.clone().unwrap_or_else(random_token),
        session: random_token(),
        session_cookie,
        csrf: random_token(),
        allowed_hosts,
        statement_timeout: options.statement_timeout,
        rates: Mutex::new(Rates::default()),
    });
    tokio::spawn(sample(console.clone(), options.sample_every));
    let app = Router::new()
        .route("/", get(overview))
        .route("/group", get(group))
        .route("/preview", post(preview))
        .route("/apply", post(apply))
        .route("/style.css", get(style))
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console.clone());
    // Scripts (and the tests) read the address from this line: a port of 0 picks a free one.
    eprintln!("sqlstreams console: listening on http://{local}/");
    if given.is_none() {
        eprintln!(
            "sqlstreams console: open http://{local}/?token={} once (a new token each start; \
             set SQLSTREAMS_CONSOLE_TOKEN to keep one)",
            console.token
        );
    }
    axum::serve(listener, app).await.map_err(|e| e.to_string())
}

/// 32 random bytes as hex.
fn random_token() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// A link to `path` for one group.
pub(crate) fn link(path: &str, stream: &str, group: &str) -> String {
    let query = serde_urlencoded::to_string([("stream", stream), ("group", group)]).expect("strings encode");
    format!("{path}?{query}")
}

/// A database error as the CLI prints it: message, SQLSTATE and hint, never more.
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.hint() {
            Some(hint) => format!("{} ({}). {hint}", db.message(), db.code().code()),
            None => format!("{} ({})", db.message(), db.code().code()),
        },
        None => format!("the database could not be reached: {e}"),
    }
}

/// Reads every group now and then for the rate charts.
async fn sample(console: Shared, every: Duration) {
    let mut tick = tokio::time::interval(every);
    // After a stall, the next reading comes an interval later, not in a burst.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // A failed reading only leaves a gap in the charts; the pages report the error.
        if let Ok(db) = console.db().await {
            if let Ok(statuses) = Status::all(&**db).await {
                console.rates().record(&statuses, Instant::now());
            }
        }
    }
}

impl Console {
    async fn db(&self) -> Result<deadpool_postgres::Object, String> {
        let db = self.client.pool().get().await.map_err(|e| sqlstreams_client::Error::from(e).to_string())?;
        // A preview's transaction is rolled back when it is dropped; the timeout is a backstop.
        // Times it pins (a purge's cutoff) are written and read back as ISO, in UTC.
        db.execute(
            "SELECT set_config('statement_timeout', $1, false), \
                    set_config('idle_in_transaction_session_timeout', '60s', false), \
                    set_config('DateStyle', 'ISO', false), set_config('TimeZone', 'UTC', false)",
            &[&self.statement_timeout],
        )
        .await
        .map_err(|e| describe(&e))?;
        Ok(db)
    }

    /// The rate samples; a page that panicked while it held them left them whole.
    fn rates(&self) -> std::sync::MutexGuard<'_, Rates> {
        self.rates.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `authority` (HOST[:PORT]) is one the console is reached by.
    fn reached_as(&self, authority: &str) -> bool {
        self.allowed_hosts.iter().any(|allowed| allowed.eq_ignore_ascii_case(authority))
    }

    fn frame(&self, title: impl Into<String>, may_act: Option<bool>) -> Frame<'_> {
        Frame { title: title.into(), csrf: &self.csrf, may_act }
    }
}

/// A page with a status.
fn page(status: StatusCode, markup: Markup) -> Response {
    (status, markup).into_response()
}

/// Refuses a request before any page is made.
fn refuse(status: StatusCode, why: &str) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], format!("sqlstreams console: {why}\n"))
        .into_response()
}

/// Who may reach the console, and the headers every answer carries (see the module's comment).
async fn guard(State(console): State<Shared>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
    if !console.reached_as(host) {
        return secured(refuse(StatusCode::MISDIRECTED_REQUEST, &format!("not served for host {host:?}")));
    }
    let offered = request.uri().query().and_then(|q| {
        let pairs = serde_urlencoded::from_str::<Vec<(String, String)>>(q).ok()?;
        pairs.into_iter().find_map(|(k, v)| (k == "token").then_some(v))
    });
    if let Some(offered) = offered {
        if request.method() == Method::GET && same(&offered, &console.token) {
            // The token leaves the address bar (and the history) for a session cookie scripts
            // cannot read.
            let cookie = format!("{}={}; HttpOnly; SameSite=Strict; Path=/", console.session_cookie, console.session);
            let mut response = Redirect::to("/").into_response();
            response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("hex"));
            return secured(response);
        }
    }
    let admitted = match presented(headers, &console.session_cookie) {
        Some(Presented::Bearer(token)) => same(&token, &console.token),
        Some(Presented::Session(session)) => same(&session, &console.session),
        None => false,
    };
    if !admitted {
        return secured(refuse(
            StatusCode::UNAUTHORIZED,
            "this console needs its token: open /?token=<token> once, or send Authorization: Bearer <token>",
        ));
    }
    if request.method() == Method::POST {
        // The console's own pages post from an origin it is reached by (behind a TLS proxy, an
        // https one); "null" (a sandboxed or privacy-stripped request) is none of them.
        let origin_ok = headers.get(header::ORIGIN).is_none_or(|origin| {
            let origin = origin.to_str().unwrap_or("");
            let authority = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
            authority.is_some_and(|a| console.reached_as(a))
        });
        let site_ok = headers
            .get("sec-fetch-site")
            .is_none_or(|site| matches!(site.to_str().unwrap_or(""), "same-origin" | "none"));
        if !origin_ok || !site_ok {
            return secured(refuse(StatusCode::FORBIDDEN, "a change must come from the console's own pages"));
        }
    }
    secured(next.run(request).await)
}

/// What a request offers to be admitted.
enum Presented {
    Bearer(String),
    Session(String),
}

/// The bearer token or the session cookie a request carries.
fn presented(headers: &HeaderMap, cookie: &str) -> Option<Presented> {
    let bearer =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if let Some(token) = bearer {
        return Some(Presented::Bearer(token.to_string()));
    }
    let cookies = headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';'));
    cookies.into_iter().find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        (name == cookie).then(|| Presented::Session(value.to_string()))
    })
}

fn secured(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // Not "no-referrer": browsers then send `Origin: null` with the console's own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], pages::STYLE).into_response()
}

async fn overview(State(console): State<Shared>) -> Response {
    let answer = async {
        let db = console.db().await?;
        Ok::<_, String>((view::may_act(&**db).await?, Status::all(&**db).await?))
    };
    match answer.await {
        Ok((may_act, groups)) => {
            let rates = console.rates();
            page(StatusCode::OK, pages::overview(&console.frame("Streams", Some(may_act)), &groups, &rates))
        }
        Err(e) => page(StatusCode::SERVICE_UNAVAILABLE, pages::error(&console.frame("Error", None), &e, None)),
    }
}

#[derive(Deserialize)]
struct GroupQuery {
    stream: String,
    group: String,
    #[serde(default)]
    done: Option<String>,
}

async fn group(State(console): State<Shared>, Query(q): Query<GroupQuery>) -> Response {
    let db = match console.db().await {
        Ok(db) => db,
        Err(e) => return page(StatusCode::SERVICE_UNAVAILABLE, pages::error(&console.frame("Error", None), &e, None)),
    };
    let answer = async {
        let may_act = view::may_act(&**db).await?;
        let status = Status::read(&**db, &q.stream, &q.group).await?;
        let blocked = Blocked::read(&**db, &q.stream, &q.group).await?;
        let dead = Dead::read(&**db, &q.stream, &q.group).await?;
        Ok::<_, String>((may_act, status, blocked, dead))
    };
    match answer.await {
        Ok((may_act, status, blocked, dead)) => {
            let rates = console.rates();
            let frame = console.frame(format!("{} / {}", q.stream, q.group), Some(may_act));
            page(StatusCode::OK, pages::group(&frame, &status, &blocked, &dead, &rates, q.done.as_deref()))
        }
        Err(e) => page(StatusCode::NOT_FOUND, pages::error(&console.frame("Error", None), &e, None)),
    }
}

/// A posted change, checked: the CSRF token, the action, and the role's right to act.
async fn checked(console: &Console, form: &actions::Form) -> Result<(deadpool_postgres::Object, Action), Response> {
    let back = Some(link("/group", &form.stream, &form.group));
    let refused =
        |status, message: &str| page(status, pages::error(&console.frame("Not done", None), message, back.clone()));
    if !same(&form.csrf, &console.csrf) {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "the form is not one of this console's pages (CSRF token): reload the page",
        ));
    }
    let action = Action::from_form(form).map_err(|e| refused(StatusCode::BAD_REQUEST, &e))?;
    let db = console.db().await.map_err(|e| refused(StatusCode::SERVICE_UNAVAILABLE, &e))?;
    if !view::may_act(&**db).await.map_err(|e| refused(StatusCode::SERVICE_UNAVAILABLE, &e))? {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "this console's role may not change groups: connect it as a member of sqlstreams_admin",
        ));
    }
    Ok((db, action))
}

async fn preview(State(console): State<Shared>, Form(form): Form<actions::Form>) -> Response {
    let (mut db, action) = match checked(&console, &form).await {
        Ok(checked) => checked,
        Err(response) => return response,
    };
    let back = Some(link("/group", &form.stream, &form.group));
    if !action.previewed() {
        return page(
            StatusCode::BAD_REQUEST,
            pages::error(&console.frame("Not done", None), "nothing to preview", back),
        );
    }
    let answer = async {
        let status = Status::read(&**db, &form.stream, &form.group).await?;
        let preview = action.preview(&mut db, &form.stream, &form.group).await?;
        Ok::<_, String>((status, preview))
    };
    match answer.await {
        Ok((status, preview)) => {
            let frame = console.frame(format!("Preview: {}", action.describe()), Some(true));
            page(StatusCode::OK, pages::preview(&frame, &status, &action, &preview))
        }
        Err(e) => page(StatusCode::CONFLICT, pages::error(&console.frame("Not done", None), &e, back)),
    }
}

async fn apply(State(console): State<Shared>, Form(form): Form<actions::Form>) -> Response {
    let (db, action) = match checked(&console, &form).await {
        Ok(checked) => checked,
        Err(response) => return response,
    };
    match action.run(&**db, &form.stream, &form.group).await {
        Ok(done) => {
            let done = done.to_string();
            let to = format!(
                "{}&{}",
                link("/group", &form.stream, &form.group),
                serde_urlencoded::to_string([("done", done)]).expect("a string encodes")
            );
            Redirect::to(&to).into_response()
        }
        Err(e) => {
            let back = Some(link("/group", &form.stream, &form.group));
            page(StatusCode::CONFLICT, pages::error(&console.frame("Not done", None), &e, back))
        }
    }
}

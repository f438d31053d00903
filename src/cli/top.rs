//! `cxlkv top`: a live terminal view of a running server, polling `Stats`.
//!
//! Three parts, so that everything but the terminal is testable headless:
//!
//! - a poller thread (`cxlkv-top-poll`) sends one [`Report`] (or the error)
//!   per interval over a bounded channel, so that a slow or absent server
//!   never blocks the keyboard;
//! - [`History`] keeps the last `--history` reports (a bounded ring; a
//!   restarted directory — a new epoch, or an uptime that went backwards —
//!   starts it afresh, since its counters start again from zero);
//! - [`draw`] is a pure function of (history, [`View`]) to a frame: pool
//!   fill per device as gauges, per-operation rates (differences of the
//!   cumulative counters over the server's own uptime) with their latency,
//!   sparklines of the request rate and of the selected operation's p99,
//!   the per-instance table, pins and evictions.
//!
//! The terminal is put in raw mode on the alternate screen by
//! `TerminalGuard`, whose drop (also on an error, and from the panic hook)
//! restores it. `q`, `Esc` or Ctrl-C quit; `←`/`→` choose the operation
//! whose latency is drawn.
//!
//! The server reports latency as percentiles since its start (the `Stats`
//! reply carries no histogram), so the p99 sparkline shows how that
//! cumulative figure moves, not a per-interval p99; the per-interval
//! distribution is in the `/metrics` histograms.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Sparkline, Table};

use super::stats::{ConnectArgs, Report, human_bytes, human_latency, human_ns};

/// Most reports kept (one hour at one per second).
pub const MAX_HISTORY: usize = 3600;
/// Shortest and longest polling interval.
pub const MIN_INTERVAL_MS: u64 = 100;
pub const MAX_INTERVAL_MS: u64 = 60_000;
/// How long the keyboard is waited for between checks of the channel.
const INPUT_POLL: Duration = Duration::from_millis(100);
/// How long quitting waits for the poller (it may be inside a request).
const POLLER_JOIN_WAIT: Duration = Duration::from_secs(2);
/// Pools drawn as gauges at most (the rest are summarised).
const MAX_POOL_GAUGES: usize = 8;

/// Flags of `cxlkv top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Time between two `Stats` requests.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// Reports kept for the sparklines (at most 3600).
    #[arg(long, default_value_t = 300)]
    pub history: usize,
}

/// The last reports, oldest first (see the module essay).
#[derive(Debug, Clone)]
pub struct History {
    samples: VecDeque<Report>,
    capacity: usize,
    /// The last poll's failure, cleared by the next success.
    last_error: Option<String>,
}

impl History {
    /// Keeps at most `capacity` reports (at least 2: a rate needs two).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(2, MAX_HISTORY);
        Self {
            samples: VecDeque::with_capacity(capacity),
            capacity,
            last_error: None,
        }
    }

    pub fn push(&mut self, report: Report) {
        if let Some(last) = self.samples.back()
            && (last.directory_epoch != report.directory_epoch || last.uptime_ms > report.uptime_ms)
        {
            self.samples.clear();
        }
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(report);
        self.last_error = None;
    }

    pub fn fail(&mut self, error: String) {
        self.last_error = Some(error);
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn latest(&self) -> Option<&Report> {
        self.samples.back()
    }

    /// Per-second rate of `counter` over each interval between two
    /// consecutive reports, oldest first.
    pub fn rates(&self, counter: impl Fn(&Report) -> u64) -> Vec<u64> {
        self.samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .map(|(a, b)| {
                rate(
                    counter(a),
                    counter(b),
                    b.uptime_ms.saturating_sub(a.uptime_ms),
                )
            })
            .collect()
    }

    /// The rate of `counter` over the last interval (0 with fewer than two
    /// reports).
    pub fn last_rate(&self, counter: impl Fn(&Report) -> u64) -> u64 {
        let n = self.samples.len();
        if n < 2 {
            return 0;
        }
        let (a, b) = (&self.samples[n - 2], &self.samples[n - 1]);
        rate(
            counter(a),
            counter(b),
            b.uptime_ms.saturating_sub(a.uptime_ms),
        )
    }

    /// `field` of every report, oldest first.
    pub fn series(&self, field: impl Fn(&Report) -> u64) -> Vec<u64> {
        self.samples.iter().map(field).collect()
    }
}

/// Events per second between two readings of a cumulative counter.
fn rate(before: u64, after: u64, elapsed_ms: u64) -> u64 {
    if elapsed_ms == 0 {
        return 0;
    }
    after.saturating_sub(before).saturating_mul(1000) / elapsed_ms
}

/// What the user chose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Index into the latest report's operations (by name order) whose
    /// latency is drawn; wraps around.
    pub selected_op: usize,
}

impl View {
    fn op_name<'a>(&self, r: &'a Report) -> Option<&'a str> {
        let n = r.ops.len();
        if n == 0 {
            return None;
        }
        r.ops.keys().nth(self.selected_op % n).copied()
    }
}

fn total_requests(r: &Report) -> u64 {
    r.ops.values().map(|o| o.requests).sum()
}

/// Draws one frame of `cxlkv top` from `history` (pure: no I/O, no clock).
pub fn draw(frame: &mut Frame, history: &History, view: &View) {
    let area = frame.area();
    let Some(latest) = history.latest() else {
        let text = match &history.last_error {
            Some(e) => format!("cxlkv top: no statistics yet: {e}"),
            None => "cxlkv top: waiting for the first statistics…".to_owned(),
        };
        frame.render_widget(Paragraph::new(text), area);
        return;
    };
    let pools_h = latest.pools.len().clamp(1, MAX_POOL_GAUGES) as u16 + 2;
    let [header, pools, middle, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(pools_h),
        Constraint::Min(8),
        Constraint::Min(6),
    ])
    .areas(area);
    draw_header(frame, header, history, latest);
    draw_pools(frame, pools, latest);
    let [ops, sparks] =
        Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(middle);
    draw_ops(frame, ops, history, latest, view);
    draw_sparklines(frame, sparks, history, latest, view);
    let [instances, side] =
        Layout::horizontal([Constraint::Percentage(65), Constraint::Percentage(35)]).areas(bottom);
    draw_instances(frame, instances, latest);
    draw_pins(frame, side, history, latest);
}

fn draw_header(frame: &mut Frame, area: Rect, history: &History, r: &Report) {
    let mut spans = vec![
        Span::styled("cxlkv top", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!(
            "  directory {} epoch {:#x}  up {}s  {} keys  {} sessions  [q quits, ←/→ op]",
            r.directory_id,
            r.directory_epoch,
            r.uptime_ms / 1000,
            r.totals.keys,
            r.totals.sessions,
        )),
    ];
    if let Some(e) = &history.last_error {
        spans.push(Span::styled(
            format!("  poll failed: {e}"),
            Style::new().fg(Color::Red),
        ));
    }
    frame.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn draw_pools(frame: &mut Frame, area: Rect, r: &Report) {
    let block = Block::default().borders(Borders::ALL).title("pools");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let shown = r.pools.len().min(MAX_POOL_GAUGES);
    if shown == 0 {
        frame.render_widget(Paragraph::new("no pool reported yet"), inner);
        return;
    }
    let rows = Layout::vertical(vec![Constraint::Length(1); shown]).split(inner);
    for (p, row) in r.pools.iter().zip(rows.iter()) {
        let label = format!(
            "pool {} {}: {} of {} allocated ({:.1}%), {} keys use {}",
            p.pool,
            p.path,
            human_bytes(p.size_bytes.saturating_sub(p.free_bytes)),
            human_bytes(p.size_bytes),
            p.fill * 100.0,
            p.keys,
            human_bytes(p.used_bytes),
        );
        let color = if p.fill >= 0.9 {
            Color::Red
        } else if p.fill >= 0.75 {
            Color::Yellow
        } else {
            Color::Green
        };
        let gauge = Gauge::default()
            .gauge_style(Style::new().fg(color))
            .ratio(p.fill)
            .label(label);
        frame.render_widget(gauge, *row);
    }
}

fn draw_ops(frame: &mut Frame, area: Rect, history: &History, r: &Report, view: &View) {
    let selected = view.op_name(r);
    let rows: Vec<Row> = r
        .ops
        .iter()
        .filter(|(name, op)| op.requests > 0 || Some(**name) == selected)
        .map(|(name, op)| {
            let name = *name;
            let per_op = |f: fn(&super::stats::OpRow) -> u64| {
                history.last_rate(|rep| rep.ops.get(name).map_or(0, f))
            };
            let row = Row::new(vec![
                name.to_owned(),
                per_op(|o| o.requests).to_string(),
                per_op(|o| o.items).to_string(),
                per_op(|o| o.errors).to_string(),
                op.requests.to_string(),
                human_latency(op.latency.count, op.latency.p50_ns),
                human_latency(op.latency.count, op.latency.p99_ns),
            ]);
            if Some(name) == selected {
                row.style(Style::new().add_modifier(Modifier::REVERSED))
            } else {
                row
            }
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(15),
            Constraint::Length(8),
            Constraint::Length(9),
            Constraint::Length(6),
            Constraint::Length(10),
            Constraint::Length(8),
            Constraint::Length(8),
        ],
    )
    .header(
        Row::new(vec![
            "op", "req/s", "items/s", "err/s", "total", "p50", "p99",
        ])
        .style(Style::new().add_modifier(Modifier::BOLD)),
    )
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title("operations (rates over the last interval; latency since start)"),
    );
    frame.render_widget(table, area);
}

fn draw_sparklines(frame: &mut Frame, area: Rect, history: &History, r: &Report, view: &View) {
    let [top, bottom] =
        Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let rates = history.rates(total_requests);
    let now = rates.last().copied().unwrap_or(0);
    let spark = Sparkline::default()
        .block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!("requests/s, all ops: {now}")),
        )
        .style(Style::new().fg(Color::Cyan))
        .data(tail(&rates, top.width.saturating_sub(2)));
    frame.render_widget(spark, top);
    let (title, series) = match view.op_name(r) {
        Some(name) => {
            let series = history.series(|rep| {
                rep.ops
                    .get(name)
                    .map_or(0, |o| o.latency.p99_ns.div_ceil(1000))
            });
            let now = r.ops.get(name).map_or(0, |o| o.latency.p99_ns);
            (
                format!("{name} p99 (since start): {}", human_ns(now)),
                series,
            )
        }
        None => ("no operation yet".to_owned(), Vec::new()),
    };
    let spark = Sparkline::default()
        .block(Block::default().borders(Borders::ALL).title(title))
        .style(Style::new().fg(Color::Magenta))
        .data(tail(&series, bottom.width.saturating_sub(2)));
    frame.render_widget(spark, bottom);
}

/// The last `width` values (what fits in a sparkline that wide).
fn tail(values: &[u64], width: u16) -> Vec<u64> {
    let skip = values.len().saturating_sub(usize::from(width));
    values[skip..].to_vec()
}

fn draw_instances(frame: &mut Frame, area: Rect, r: &Report) {
    let rows: Vec<Row> = r
        .instances
        .iter()
        .map(|i| {
            let mut name = i.instance_id.clone();
            if i.instance_id == r.observer_instance {
                name.push_str(" (top)");
            }
            Row::new(vec![
                name,
                i.sessions.to_string(),
                i.keys.to_string(),
                human_bytes(i.used_bytes),
                human_bytes(i.owned_bytes),
                if i.quota_bytes == 0 {
                    "-".to_owned()
                } else {
                    human_bytes(i.quota_bytes)
                },
                i.pins.to_string(),
                i.notices_pending.to_string(),
            ])
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Min(16),
            Constraint::Length(4),
            Constraint::Length(9),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(6),
            Constraint::Length(7),
        ],
    )
    .header(
        Row::new(vec![
            "instance", "sess", "keys", "used", "owned", "quota", "pins", "notices",
        ])
        .style(Style::new().add_modifier(Modifier::BOLD)),
    )
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(format!("instances ({})", r.instances.len())),
    );
    frame.render_widget(table, area);
}

fn draw_pins(frame: &mut Frame, area: Rect, history: &History, r: &Report) {
    let t = &r.totals;
    let o = &r.outcomes;
    let lines = vec![
        Line::from(format!("pins {} on {} keys", t.pins, t.pinned_keys)),
        Line::from(format!(
            "pinned pairs {} of {} ({}), ledgers {}",
            t.pinned_entries,
            t.max_pinned_entries,
            super::stats::percent(t.pinned_entries, t.max_pinned_entries),
            human_bytes(t.pin_ledger_bytes)
        )),
        Line::from(format!(
            "long-held (> {}s) {}",
            r.long_pin_threshold_ms / 1000,
            t.long_held_pins
        )),
        Line::from(format!(
            "evictions orphan {} (+{}/s)",
            t.evictions_orphan,
            history.last_rate(|rep| rep.totals.evictions_orphan)
        )),
        Line::from(format!(
            "evictions lru {} (+{}/s)",
            t.evictions_lru,
            history.last_rate(|rep| rep.totals.evictions_lru)
        )),
        Line::from(format!(
            "deletes {} (+{}/s)",
            o.deleted,
            history.last_rate(|rep| rep.outcomes.deleted)
        )),
        Line::from(format!(
            "notices pending {}, issued {}",
            t.notices_pending, t.notices_issued
        )),
        Line::from(format!(
            "lookup hits {} misses {}",
            o.lookup_hits, o.lookup_misses
        )),
    ];
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title("pins & evictions"),
        ),
        area,
    );
}

/// Raw mode on the alternate screen, restored on drop.
struct TerminalGuard;

impl TerminalGuard {
    fn enter() -> io::Result<Self> {
        crossterm::terminal::enable_raw_mode()?;
        let guard = TerminalGuard;
        crossterm::execute!(
            io::stdout(),
            crossterm::terminal::EnterAlternateScreen,
            crossterm::terminal::Clear(crossterm::terminal::ClearType::All),
            crossterm::cursor::Hide
        )?;
        Ok(guard)
    }

    fn restore() {
        // Best effort: the terminal may already be gone.
        let _ = crossterm::execute!(
            io::stdout(),
            crossterm::terminal::LeaveAlternateScreen,
            crossterm::cursor::Show
        );
        let _ = crossterm::terminal::disable_raw_mode();
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        Self::restore();
    }
}

/// Runs `cxlkv top` until `q`, `Esc` or Ctrl-C.
pub fn run(args: &TopArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(&args.interval_ms),
        "--interval-ms {} is not in {MIN_INTERVAL_MS}..={MAX_INTERVAL_MS}",
        args.interval_ms
    );
    anyhow::ensure!(
        (2..=MAX_HISTORY).contains(&args.history),
        "--history {} is not in 2..={MAX_HISTORY}",
        args.history
    );
    // A full-screen view drawn into a pipe or a file would be escape codes
    // without end: refuse before connecting (a session the server would
    // count for nothing).
    anyhow::ensure!(
        io::IsTerminal::is_terminal(&io::stdout()),
        "cxlkv top draws a live full-screen view and needs a terminal on standard output; \
         for a pipe, a file or a script use `cxlkv stats` (`--json` for one JSON line)"
    );
    // Connect before the screen changes, so that a failure reads normally.
    let client = args.connect.connect("top")?;
    let stop = Arc::new(AtomicBool::new(false));
    // Two reports in flight at most: the poller waits for the screen.
    let (tx, rx) = mpsc::sync_channel::<Result<Report, String>>(2);
    let poller = {
        let stop = Arc::clone(&stop);
        let interval = Duration::from_millis(args.interval_ms);
        std::thread::Builder::new()
            .name("cxlkv-top-poll".into())
            .spawn(move || {
                // Relaxed: a flag checked once per slice; nothing else is
                // published through it.
                while !stop.load(Ordering::Relaxed) {
                    let next = Instant::now() + interval;
                    let report = super::stats::fetch(&client).map_err(|e| format!("{e:#}"));
                    if tx.send(report).is_err() {
                        break;
                    }
                    while Instant::now() < next && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(INPUT_POLL.min(interval));
                    }
                }
                if let Err(e) = client.close() {
                    tracing::debug!(error = %e, "closing the top session");
                }
            })
            .context("cannot start the polling thread")?
    };
    let result = ui_loop(&rx, args.history);
    // Relaxed: see the poller.
    stop.store(true, Ordering::Relaxed);
    drop(rx);
    let deadline = Instant::now() + POLLER_JOIN_WAIT;
    while !poller.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if poller.is_finished() && poller.join().is_err() {
        tracing::error!("the polling thread panicked");
    }
    result
}

fn ui_loop(rx: &mpsc::Receiver<Result<Report, String>>, capacity: usize) -> anyhow::Result<()> {
    let previous_hook = Arc::new(std::panic::take_hook());
    {
        let previous_hook = Arc::clone(&previous_hook);
        std::panic::set_hook(Box::new(move |info| {
            TerminalGuard::restore();
            previous_hook(info);
        }));
    }
    let _guard = TerminalGuard::enter()
        .context("cannot set up the terminal (cxlkv top needs a controlling terminal)")?;
    let backend = ratatui::backend::CrosstermBackend::new(io::stdout());
    // Not `Terminal::clear`: it asks the terminal for the cursor position,
    // which not every terminal (or pty) answers; `enter` cleared the screen.
    let mut terminal = ratatui::Terminal::new(backend)?;
    let mut history = History::new(capacity);
    let mut view = View::default();
    let mut dirty = true;
    loop {
        loop {
            match rx.try_recv() {
                Ok(Ok(report)) => history.push(report),
                Ok(Err(e)) => history.fail(e),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    anyhow::bail!("the polling thread stopped")
                }
            }
            dirty = true;
        }
        if dirty {
            terminal.draw(|f| draw(f, &history, &view))?;
            dirty = false;
        }
        if !event::poll(INPUT_POLL)? {
            continue;
        }
        match event::read()? {
            Event::Key(k) if k.kind == KeyEventKind::Press => match k.code {
                KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                    return Ok(());
                }
                KeyCode::Left => {
                    let n = history.latest().map_or(1, |r| r.ops.len().max(1));
                    view.selected_op = (view.selected_op + n - 1) % n;
                    dirty = true;
                }
                KeyCode::Right => {
                    view.selected_op = view.selected_op.wrapping_add(1);
                    dirty = true;
                }
                _ => {}
            },
            Event::Resize(..) => dirty = true,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::stats::tests::sample_reply;
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn report(uptime_ms: u64, lookups: u64) -> Report {
        Report::new(
            &sample_reply(uptime_ms, lookups),
            &[(0, "/dev/shm/pool-a".into())],
            "cxlkv-top-1",
        )
    }

    fn screen(history: &History, view: &View) -> String {
        let mut terminal = Terminal::new(TestBackend::new(140, 40)).unwrap();
        terminal.draw(|f| draw(f, history, view)).unwrap();
        let buf = terminal.backend().buffer();
        let mut text = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                text.push_str(buf[(x, y)].symbol());
            }
            text.push('\n');
        }
        text
    }

    #[test]
    fn one_frame_shows_pools_rates_instances_and_pins() {
        let mut h = History::new(10);
        h.push(report(10_000, 1_000));
        // 500 lookups more over 2 s: 250/s.
        h.push(report(12_000, 1_500));
        let text = screen(&h, &View::default());
        for needle in [
            "cxlkv top",
            "directory dir-a",
            "pool 0 /dev/shm/pool-a: 256.0 MiB of 1.0 GiB allocated (25.0%)",
            "lookup",
            "250",
            "1500",
            "40.0µs",
            "requests/s, all ops: 250",
            "lookup p99 (since start): 40.0µs",
            "engine-a",
            "cxlkv-stats-1",
            "pins 6 on",
            "pinned pairs 3 of 1000 (0.3%), ledgers 16.0 KiB",
            "evictions orphan 7 (+0/s)",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
    }

    #[test]
    fn the_chosen_operation_gets_the_latency_sparkline_and_the_choice_wraps() {
        let mut r = report(10_000, 100);
        let mut register = r.ops["lookup"];
        register.latency.p99_ns = 123_000;
        r.ops.insert("register", register);
        let mut h = History::new(4);
        h.push(r);
        // By name: lookup, register.
        let text = screen(&h, &View { selected_op: 1 });
        assert!(
            text.contains("register p99 (since start): 123.0µs"),
            "{text}"
        );
        let text = screen(&h, &View { selected_op: 2 });
        assert!(text.contains("lookup p99 (since start): 40.0µs"), "{text}");
    }

    #[test]
    fn before_the_first_report_the_frame_says_why_it_is_empty() {
        let mut h = History::new(10);
        assert!(screen(&h, &View::default()).contains("waiting for the first statistics"));
        h.fail("connection refused".into());
        assert!(screen(&h, &View::default()).contains("connection refused"));
    }

    #[test]
    fn history_is_bounded_and_restarts_with_the_directory() {
        let mut h = History::new(3);
        for i in 0..5 {
            h.push(report(1_000 * (i + 1), 100 * i));
        }
        assert_eq!(h.len(), 3);
        assert_eq!(h.rates(total_requests), vec![100, 100]);
        // Uptime went backwards: a restarted directory's counters.
        h.push(report(500, 0));
        assert_eq!(h.len(), 1);
        assert_eq!(h.last_rate(total_requests), 0);
    }

    #[test]
    fn rates_divide_by_the_servers_elapsed_time() {
        assert_eq!(rate(10, 110, 500), 200);
        assert_eq!(rate(10, 110, 0), 0, "no time passed");
        assert_eq!(rate(110, 10, 1000), 0, "a counter never goes back");
    }
}

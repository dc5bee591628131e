//! `shotfleet status --watch`: the status redrawn every second, with the workers heard of in
//! the last minute (their answers to pings, their progress events) and what they hold; q, Esc
//! or Ctrl-C quits. Off a terminal each frame is printed after the last, until Ctrl-C.

use std::io::Write as _;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyModifiers};
use crossterm::{cursor, execute, queue, terminal};
use futures::StreamExt;
use shotfleet_schema::progress::{self, ShotProgress, WorkerState};
use shotfleet_schema::subject;

use crate::fleet::{self, Fleet};
use crate::status;

/// How often the screen is redrawn.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long the first frame waits for the workers' answers (a live worker answers within
/// milliseconds; the frames after wait a whole [`EVERY`]).
const FIRST_ANSWERS: Duration = Duration::from_millis(500);

/// The progress events a status follows: every project's, or `project`'s alone.
pub fn events_subject(project: Option<&str>) -> String {
    project.map_or_else(|| format!("{}.progress.>", subject::ROOT), progress::project_subjects)
}

/// Watches until the person quits. `project`: follow only its progress events (a producer may
/// read no other project's).
///
/// # Errors
/// A subscription failed, or the status could not be read.
pub async fn watch(js: &jetstream::Context, project: Option<&str>, interactive: bool) -> Result<(), String> {
    let client = js.client();
    let mut events = client.subscribe(events_subject(project)).await.map_err(|e| e.to_string())?;
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    let screen = interactive.then(Screen::enter).transpose().map_err(|e| format!("cannot take over the terminal: {e}"))?;
    let (quit_tx, mut quit) = tokio::sync::mpsc::channel::<()>(1);
    if screen.is_some() {
        std::thread::spawn(move || keys(&quit_tx));
    }
    let mut fleet = Fleet::default();
    // Each frame shows the answers to the ping sent after the frame before: the first frame
    // waits a little for the first answers, or it would show no worker at all.
    let _ = fleet::ping_to(&client, &inbox).await;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + FIRST_ANSWERS, EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let status = status::read(js).await?;
                let frame = status::render(&status, &fleet, Instant::now());
                draw(&frame, screen.is_some()).map_err(|e| e.to_string())?;
                let _ = fleet::ping_to(&client, &inbox).await;
            }
            Some(message) = events.next() => {
                if let Ok(event) = serde_json::from_slice::<ShotProgress>(&message.payload) {
                    fleet.progressed(event, Instant::now());
                }
            }
            Some(message) = answers.next() => {
                if let Ok(state) = serde_json::from_slice::<WorkerState>(&message.payload) {
                    fleet.answered(state, Instant::now());
                }
            }
            _ = quit.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    drop(screen);
    Ok(())
}

/// The alternate screen in raw mode, given back when dropped (also on an error).
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Self> {
        terminal::enable_raw_mode()?;
        execute!(std::io::stdout(), terminal::EnterAlternateScreen, cursor::Hide)?;
        Ok(Self)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(std::io::stdout(), cursor::Show, terminal::LeaveAlternateScreen);
        let _ = terminal::disable_raw_mode();
    }
}

fn draw(frame: &str, interactive: bool) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if interactive {
        queue!(out, cursor::MoveTo(0, 0), terminal::Clear(terminal::ClearType::All))?;
        let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        write!(out, "shotfleet status at {stamp} (q to quit)\r\n\r\n")?;
        // A line wider than the terminal would wrap and push the frame's end off the screen:
        // it is cut at the edge (the plain output keeps whole lines for logs and pipes).
        let width = terminal::size().map_or(usize::MAX, |(columns, _)| usize::from(columns.max(1)));
        // Raw mode: a line feed does not return the carriage.
        for line in frame.lines() {
            let shown: String = line.chars().take(width).collect();
            write!(out, "{shown}\r\n")?;
        }
    } else {
        writeln!(out, "{frame}")?;
    }
    out.flush()
}

/// Reads keys until q, Esc or Ctrl-C (raw mode turns Ctrl-C into a key), then says so.
fn keys(quit: &tokio::sync::mpsc::Sender<()>) {
    loop {
        match event::poll(Duration::from_millis(200)) {
            Ok(true) => {
                if let Ok(Event::Key(KeyEvent { code, modifiers, .. })) = event::read() {
                    let ctrl_c = code == KeyCode::Char('c') && modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c || matches!(code, KeyCode::Char('q') | KeyCode::Esc) {
                        let _ = quit.blocking_send(());
                        return;
                    }
                }
            }
            Ok(false) if quit.is_closed() => return,
            Ok(false) => {}
            Err(_) => return,
        }
    }
}

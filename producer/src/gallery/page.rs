//! The contact sheet's HTML: one file, thumbnails inlined, no script but the optional refresh.

use std::fmt::Write as _;

use super::{Card, Status};

/// The page. `live`: served by `--serve`, reloads itself when a new outcome arrives.
pub fn render(project: &str, cards: &[Card], live: bool) -> String {
    let mut counts = [0usize; 5];
    for card in cards {
        counts[card.status as usize] += 1;
    }
    let mut html = String::with_capacity(4096 + cards.len() * 2048);
    let _ = write!(
        html,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>{title} · shotfleet</title>\n<style>{STYLE}</style>\n</head><body>\n<header><h1>{title}</h1><p class=\"counts\">{done} done · {degraded} degraded · {failed} failed · {cancelled} cancelled · {waiting} waiting</p></header>\n<main>\n",
        title = escape(project),
        done = counts[Status::Done as usize],
        degraded = counts[Status::Degraded as usize],
        failed = counts[Status::Failed as usize],
        cancelled = counts[Status::Cancelled as usize],
        waiting = counts[Status::Waiting as usize],
    );
    for card in cards {
        card_html(&mut html, card);
    }
    html.push_str("</main>\n");
    if live {
        html.push_str("<script>new EventSource('events').onmessage = () => location.reload();</script>\n");
    }
    html.push_str("</body></html>\n");
    html
}

fn card_html(html: &mut String, card: &Card) {
    let status = card.status.as_str();
    let _ = writeln!(html, "<article class=\"card {status}\" data-status=\"{status}\" data-job=\"{}\">", escape(&card.job_id));
    let _ = writeln!(html, "<h2><span class=\"shot\">{}</span> <span class=\"job\">{}</span></h2>", escape(&card.shot_id), escape(&card.job_id));
    if let Some(mark) = mark(card) {
        let _ = writeln!(html, "<p class=\"mark\">{}</p>", escape(&mark));
    }
    html.push_str("<div class=\"images\">");
    for (index, thumb) in card.thumbs.iter().enumerate() {
        match thumb {
            Ok(thumb) => {
                let _ = write!(
                    html,
                    "<img src=\"{}\" alt=\"{} image {index}\" title=\"{}x{}\">",
                    thumb.data_uri,
                    escape(&card.shot_id),
                    thumb.width,
                    thumb.height
                );
            }
            Err(why) => {
                let _ = write!(html, "<p class=\"missing\">image {index}: {}</p>", escape(why));
            }
        }
    }
    html.push_str("</div>\n<dl>");
    for (name, value) in facts(card) {
        let _ = write!(html, "<dt>{name}</dt><dd>{}</dd>", escape(&value));
    }
    html.push_str("</dl>\n</article>\n");
}

/// The visible mark of a shot that did not come out as asked.
fn mark(card: &Card) -> Option<String> {
    let result = card.result.as_ref();
    let failure = result.and_then(|r| r.failure.as_ref());
    match card.status {
        Status::Done => None,
        Status::Waiting => Some("waiting for a worker".into()),
        Status::Degraded => {
            let degrade = result.and_then(|r| r.degrade)?;
            Some(format!(
                "degraded (rung {}): asked {}x{}, rendered smaller: no worker could take it at full size (out of memory, or no live worker holds that size)",
                degrade.level, degrade.from.width, degrade.from.height
            ))
        }
        Status::Failed => Some(match failure {
            Some(f) => format!("failed ({}): {}", f.reason.map_or_else(|| "unknown".into(), |r| r.to_string()), f.detail),
            None => "failed".into(),
        }),
        Status::Cancelled => Some(failure.map_or_else(|| "cancelled".into(), |f| f.detail.clone())),
    }
}

/// What the sheet says about a shot, in reading order.
fn facts(card: &Card) -> Vec<(&'static str, String)> {
    let first = card.thumbs.iter().find_map(|t| t.as_ref().ok());
    let text = |key: &str| first.and_then(|t| t.text.get(key)).cloned();
    let job = card.job.as_ref();
    let result = card.result.as_ref();
    let mut facts = Vec::new();
    // What a rendered image carries is what it was rendered from: a storyboard edited since (or
    // a failed record) only fills in what the image does not say.
    if let Some(prompt) = text("prompt").or_else(|| job.map(|j| j.prompt.clone())) {
        facts.push(("prompt", prompt));
    }
    let negative = if first.is_some() { text("negative_prompt") } else { job.and_then(|j| j.negative_prompt.clone()) };
    if let Some(negative) = negative.filter(|n| !n.is_empty()) {
        facts.push(("negative", negative));
    }
    if let Some(seed) = result.and_then(|r| r.images.first()).map(|i| i.seed.to_string()).or_else(|| job.map(|j| j.seed.to_string())) {
        facts.push(("seed", seed));
    }
    let size = result
        .and_then(|r| r.images.first())
        .map(|i| format!("{}x{}", i.width, i.height))
        .or_else(|| job.map(|j| format!("{}x{}", j.width, j.height)));
    if let Some(size) = size {
        let images = result.map(|r| r.images.len()).filter(|n| *n > 0).or(job.map(|j| j.images as usize)).unwrap_or(1);
        facts.push(("size", format!("{size} x {images}")));
    }
    if let Some(steps) = text("steps").or_else(|| job.map(|j| j.steps.to_string())) {
        facts.push(("steps", steps));
    }
    if let Some(guidance) = text("guidance").or_else(|| job.map(|j| j.guidance.to_string())) {
        facts.push(("guidance", guidance));
    }
    let loras = job.map_or_else(
        || "none".to_owned(),
        |j| if j.loras.is_empty() { "none".into() } else { j.loras.iter().map(|l| format!("{} ({})", l.name, l.weight)).collect::<Vec<_>>().join(", ") },
    );
    facts.push(("LoRAs", loras));
    if let Some(result) = result.filter(|r| r.is_rendered()) {
        facts.push(("worker", format!("{} ({})", result.worker, result.device)));
        facts.push(("render", format!("{:.1} s", result.timing.render_ms as f64 / 1000.0)));
        facts.push(("queued", format!("{:.1} s", result.timing.queue_ms as f64 / 1000.0)));
        for note in &result.notes {
            facts.push(("note", note.clone()));
        }
    }
    facts
}

/// Text made safe for HTML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "\
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f3ef;color:#222}\
header{padding:16px 24px;background:#222;color:#eee}h1{margin:0;font-size:20px}.counts{margin:4px 0 0;color:#bbb}\
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:16px;padding:24px}\
.card{background:#fff;border:3px solid transparent;border-radius:6px;padding:10px;box-shadow:0 1px 3px #0002}\
.card h2{font-size:14px;margin:0 0 6px}.card .job{color:#888;font-weight:normal}\
.images{display:flex;flex-wrap:wrap;gap:4px}.images img{max-width:100%;height:auto;max-height:160px;border-radius:3px}\
dl{display:grid;grid-template-columns:auto 1fr;gap:2px 8px;margin:8px 0 0;font-size:12px}dt{color:#888}dd{margin:0;overflow-wrap:anywhere}\
.mark{margin:0 0 6px;padding:4px 6px;border-radius:3px;font-weight:600;font-size:12px}\
.degraded{border-color:#e08a00}.degraded .mark{background:#fff0d6;color:#8a5200}\
.failed{border-color:#c62828}.failed .mark{background:#fde2e2;color:#8e1b1b}\
.cancelled{opacity:.45;filter:grayscale(1)}.cancelled .mark{background:#e6e6e6;color:#555}\
.waiting{border-style:dashed;border-color:#aaa}.waiting .mark{background:#eef;color:#446}\
.missing{color:#8e1b1b;font-size:12px}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_a_storyboard_cannot_become_markup() {
        assert_eq!(escape(r#"<img src=x onerror="a('b')"> & co"#), "&lt;img src=x onerror=&quot;a(&#39;b&#39;)&quot;&gt; &amp; co");
    }

    #[test]
    fn a_rendered_shot_shows_what_it_was_rendered_from_not_an_edited_board() {
        let edited: shotfleet_schema::ShotJob = serde_json::from_value(serde_json::json!({
            "v": 1, "job_id": "j1", "project": "tide", "shot_id": "s1", "prompt": "a red submarine",
            "width": 64, "height": 64, "steps": 9, "guidance": 5.0, "seed": 1
        }))
        .unwrap();
        let text = [("prompt", "a lighthouse, at dawn"), ("steps", "30"), ("guidance", "6")].map(|(k, v)| (k.to_owned(), v.to_owned()));
        let thumb = crate::gallery::thumb::Thumb { data_uri: String::new(), width: 64, height: 64, text: text.into_iter().collect() };
        let card = Card { job_id: "j1".into(), shot_id: "s1".into(), status: Status::Done, result: None, job: Some(edited.clone()), thumbs: vec![Ok(thumb)] };
        let shown = facts(&card);
        assert!(shown.contains(&("prompt", "a lighthouse, at dawn".into())) && shown.contains(&("steps", "30".into())), "{shown:?}");
        // Without an image the board says what the shot is.
        let waiting = Card { thumbs: vec![], status: Status::Waiting, ..card };
        assert!(facts(&waiting).contains(&("prompt", "a red submarine".into())));
    }

    #[test]
    fn a_waiting_shot_is_marked_and_counted() {
        let card = Card { job_id: "j1".into(), shot_id: "s1".into(), status: Status::Waiting, result: None, job: None, thumbs: vec![] };
        let html = render("tide <ep1>", &[card], false);
        assert!(html.contains("<title>tide &lt;ep1&gt; · shotfleet</title>"));
        assert!(html.contains("1 waiting") && html.contains("data-status=\"waiting\"") && html.contains("waiting for a worker"));
        assert!(!html.contains("<script>"), "a written page has no script");
    }
}

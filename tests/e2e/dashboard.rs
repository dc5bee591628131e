//! The Grafana dashboard against a real worker: after a few jobs, every query in
//! `deploy/grafana/shotfleet.json` names metrics the worker's `/metrics` exports, with the labels
//! the query selects or groups by (a typo would leave a panel empty).

#[path = "seeing.rs"]
mod seeing;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use shotfleet_schema::Priority;
use seeing::OneWorker;
use shotfleet_testkit::paths;
use shotfleet_tests::{job, outcomes, shot, submit};

/// Metric names in the exposition, with the labels each carries.
fn exposition(text: &str) -> HashMap<String, BTreeSet<String>> {
    let mut metrics: HashMap<String, BTreeSet<String>> = HashMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = metrics.entry(line[..name_end].to_owned()).or_default();
        if let Some(inside) = line[name_end..].strip_prefix('{').and_then(|rest| rest.split('}').next()) {
            labels.extend(inside.split(',').filter_map(|pair| pair.split('=').next()).map(|l| l.trim().to_owned()));
        }
    }
    metrics
}

/// Identifiers of the query that are shotfleet metrics, with the labels selected on each.
fn metrics_in(expr: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("shotfleet_") {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let name = tail[..end].to_owned();
        let labels = tail[end..]
            .strip_prefix('{')
            .and_then(|inside| inside.split('}').next())
            .map(|inside| inside.split(',').filter_map(|m| m.split(['=', '!', '~']).next()).map(|l| l.trim().to_owned()).collect())
            .unwrap_or_default();
        found.push((name, labels));
        rest = &tail[end..];
    }
    found
}

/// The labels a query groups by (`by (a, b)`).
fn grouped_by(expr: &str) -> Vec<String> {
    expr.split("by (")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .flat_map(|labels| labels.split(',').map(|l| l.trim().to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_dashboard_query_names_metrics_the_worker_exports() {
    let fleet = OneWorker::start().await;
    let js = &fleet.js;
    let shots: Vec<_> = (1..=3).map(|n| shot(Priority::P1, job(&format!("db-{n}"), "db", (64, 64), 2, 1))).collect();
    submit(js, &shots).await;
    outcomes(js, &shots, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let exported = exposition(&fleet.worker.metrics());

    let dashboard: serde_json::Value =
        serde_json::from_slice(&std::fs::read(paths::repo_root().join("deploy/grafana/shotfleet.json")).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    // Labels Prometheus adds when it scrapes, and the histogram bucket bound.
    let scraped = ["instance", "job", "le"];
    let mut problems = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("?");
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let Some(targets) = targets else {
            problems.push(format!("panel `{title}` has no query"));
            continue;
        };
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_default();
            let named = metrics_in(expr);
            if named.is_empty() {
                problems.push(format!("`{title}`: `{expr}` names no shotfleet metric"));
            }
            let mut carried = BTreeSet::new();
            for (metric, labels) in named {
                let Some(has) = exported.get(&metric) else {
                    problems.push(format!("`{title}`: {metric} is not exported"));
                    continue;
                };
                carried.extend(has.iter().cloned());
                for label in labels.iter().filter(|l| !has.contains(*l)) {
                    problems.push(format!("`{title}`: {metric} has no label `{label}`"));
                }
            }
            for label in grouped_by(expr).iter().filter(|l| !scraped.contains(&l.as_str()) && !carried.contains(*l)) {
                problems.push(format!("`{title}`: `{expr}` groups by `{label}`, which none of its metrics carries"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

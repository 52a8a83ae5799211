//! `sluice plan` output: what the selected broker creates for a plan, as text, JSON, Graphviz
//! dot or Mermaid. Each broker says it in its own terms ([`Picture`]): RabbitMQ its queues'
//! `x-` arguments and the delay cascade (summarised as one node), the brokers that keep their
//! own declarations (embedded, Redis) the settings they keep and where a delayed copy waits.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

/// Output formats of `sluice plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanFormat {
    Text,
    Json,
    Dot,
    Mermaid,
}

/// What a broker creates for a plan, as a person reads it.
#[derive(Debug, Default)]
pub struct Picture {
    /// A line about the broker as a whole, first (none for RabbitMQ).
    pub title: Option<String>,
    /// Each exchange and its type.
    pub exchanges: Vec<(String, String)>,
    pub queues: Vec<Shown>,
    pub bindings: Vec<Bound>,
    /// Where a retry waits for its delay: one line.
    pub delays: String,
    /// A node through which every work queue's retries pass (RabbitMQ's cascade), or none
    /// (the copy waits in its own queue).
    pub delay_node: Option<&'static str>,
    /// The broker's own form of the plan, for `--format json`.
    pub json: Value,
}

/// A queue as shown.
#[derive(Debug)]
pub struct Shown {
    pub name: String,
    pub dead_letter_queue: bool,
    /// Where it dead-letters to.
    pub dead_letter: Option<String>,
    /// Its settings, `name = value`, in the broker's words.
    pub settings: Vec<(String, String)>,
}

/// A binding of a queue to an exchange, as shown.
#[derive(Debug)]
pub struct Bound {
    pub exchange: String,
    pub queue: String,
    pub routing_key: String,
    pub arguments: BTreeMap<String, Value>,
}

/// Renders the picture in the chosen format.
pub fn render(picture: &Picture, format: PlanFormat) -> String {
    match format {
        PlanFormat::Json => {
            let mut s = serde_json::to_string_pretty(&picture.json).unwrap_or_default();
            s.push('\n');
            s
        }
        PlanFormat::Text => text(picture),
        PlanFormat::Dot => graph(picture, &Dot),
        PlanFormat::Mermaid => graph(picture, &Mermaid),
    }
}

fn text(p: &Picture) -> String {
    let mut out = String::new();
    if let Some(title) = &p.title {
        let _ = writeln!(out, "{title}");
    }
    out.push_str("exchanges:\n");
    for (name, kind) in &p.exchanges {
        let _ = writeln!(out, "  {name} ({kind})");
    }
    out.push_str("queues:\n");
    for q in &p.queues {
        let role = if q.dead_letter_queue { " [dead-letter]" } else { "" };
        let _ = writeln!(out, "  {}{role}", q.name);
        for (k, v) in &q.settings {
            let _ = writeln!(out, "    {k} = {v}");
        }
        for b in p.bindings.iter().filter(|b| b.queue == q.name) {
            let _ = write!(out, "    bound to {} with key \"{}\"", b.exchange, b.routing_key);
            if !b.arguments.is_empty() {
                let _ = write!(out, " and arguments {}", Value::from_iter(b.arguments.clone()));
            }
            out.push('\n');
        }
    }
    let _ = writeln!(out, "{}", p.delays);
    out
}

/// The few things a graph format needs to say.
trait Graph {
    fn open(&self, out: &mut String);
    fn exchange(&self, out: &mut String, id: &str, label: &str);
    fn queue(&self, out: &mut String, id: &str, label: &str);
    fn edge(&self, out: &mut String, from: &str, to: &str, label: &str, dashed: bool);
    fn close(&self, out: &mut String);
}

fn graph(p: &Picture, g: &dyn Graph) -> String {
    let id = |prefix: &str, name: &str| {
        let clean: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        format!("{prefix}_{clean}")
    };
    let mut out = String::new();
    g.open(&mut out);
    for (name, kind) in &p.exchanges {
        g.exchange(&mut out, &id("x", name), &format!("{name} ({kind})"));
    }
    let work: Vec<&Shown> = p.queues.iter().filter(|q| !q.dead_letter_queue).collect();
    let delay_node = p.delay_node.filter(|_| !work.is_empty());
    if let Some(label) = delay_node {
        g.exchange(&mut out, "cascade", label);
    }
    for q in &p.queues {
        g.queue(&mut out, &id("q", &q.name), &q.name);
    }
    for b in &p.bindings {
        g.edge(&mut out, &id("x", &b.exchange), &id("q", &b.queue), &b.routing_key, false);
    }
    for q in work {
        if let Some(dlq) = &q.dead_letter {
            g.edge(&mut out, &id("q", &q.name), &id("q", dlq), "dead-letter", true);
        }
        if delay_node.is_some() {
            g.edge(&mut out, &id("q", &q.name), "cascade", "retry", true);
            g.edge(&mut out, "cascade", &id("q", &q.name), "after delay", true);
        } else {
            g.edge(&mut out, &id("q", &q.name), &id("q", &q.name), "retry after delay", true);
        }
    }
    g.close(&mut out);
    out
}

struct Dot;

fn dot_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

impl Graph for Dot {
    fn open(&self, out: &mut String) {
        out.push_str("digraph sluice {\n  rankdir=LR;\n");
    }
    fn exchange(&self, out: &mut String, id: &str, label: &str) {
        let _ = writeln!(out, "  {id} [shape=box, label={}];", dot_quote(label));
    }
    fn queue(&self, out: &mut String, id: &str, label: &str) {
        let _ = writeln!(out, "  {id} [shape=cylinder, label={}];", dot_quote(label));
    }
    fn edge(&self, out: &mut String, from: &str, to: &str, label: &str, dashed: bool) {
        let style = if dashed { ", style=dashed" } else { "" };
        let _ = writeln!(out, "  {from} -> {to} [label={}{style}];", dot_quote(label));
    }
    fn close(&self, out: &mut String) {
        out.push_str("}\n");
    }
}

struct Mermaid;

fn mermaid_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "#quot;"))
}

impl Graph for Mermaid {
    fn open(&self, out: &mut String) {
        out.push_str("flowchart LR\n");
    }
    fn exchange(&self, out: &mut String, id: &str, label: &str) {
        let _ = writeln!(out, "  {id}[{}]", mermaid_quote(label));
    }
    fn queue(&self, out: &mut String, id: &str, label: &str) {
        let _ = writeln!(out, "  {id}[({})]", mermaid_quote(label));
    }
    fn edge(&self, out: &mut String, from: &str, to: &str, label: &str, dashed: bool) {
        let arrow = if dashed { "-.->" } else { "-->" };
        let label = if label.is_empty() { "\"\"".to_string() } else { mermaid_quote(label) };
        let _ = writeln!(out, "  {from} {arrow}|{label}| {to}");
    }
    fn close(&self, _: &mut String) {}
}

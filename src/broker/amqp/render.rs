//! `sluice plan` output: the plan as text, JSON, Graphviz dot or Mermaid. The pictures show
//! exchanges, queues, bindings and dead-letter edges; the delay cascade is summarised as one node.

use std::fmt::Write as _;

use super::declare::{DELAY_LEVELS, DELAY_UNIT, DELIVERY_EXCHANGE, Declarations, DestinationKind, Role};

/// Output formats of `sluice plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanFormat {
    Text,
    Json,
    Dot,
    Mermaid,
}

const CASCADE: &str = "delay cascade";

/// Renders the plan in the chosen format.
pub fn render(plan: &Declarations, format: PlanFormat) -> String {
    match format {
        PlanFormat::Json => {
            let mut s = serde_json::to_string_pretty(plan).unwrap_or_default();
            s.push('\n');
            s
        }
        PlanFormat::Text => text(plan),
        PlanFormat::Dot => graph(plan, &Dot),
        PlanFormat::Mermaid => graph(plan, &Mermaid),
    }
}

fn is_internal(name: &str) -> bool {
    name.starts_with("sluice.delay.")
}

fn text(plan: &Declarations) -> String {
    let mut out = String::from("exchanges:\n");
    for e in plan.exchanges.iter().filter(|e| !is_internal(&e.name)) {
        let _ = writeln!(out, "  {} ({})", e.name, e.kind);
    }
    out.push_str("queues:\n");
    for q in plan.queues.iter().filter(|q| q.role != Role::Delay) {
        let role = if q.role == Role::DeadLetter { " [dead-letter]" } else { "" };
        let _ = writeln!(out, "  {}{role}", q.name);
        for (k, v) in &q.arguments {
            let _ = writeln!(out, "    {k} = {v}");
        }
        for b in plan.bindings.iter().filter(|b| b.destination == q.name && !is_internal(&b.source)) {
            let _ = write!(out, "    bound to {} with key \"{}\"", b.source, b.routing_key);
            if !b.arguments.is_empty() {
                let _ = write!(out, " and arguments {}", serde_json::Value::from_iter(b.arguments.clone()));
            }
            out.push('\n');
        }
    }
    let _ = writeln!(
        out,
        "delay cascade: {DELAY_LEVELS} levels (sluice.delay.00 .. sluice.delay.{:02}) in units of {}ms, into {}",
        DELAY_LEVELS - 1,
        DELAY_UNIT.as_millis(),
        DELIVERY_EXCHANGE
    );
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

fn graph(plan: &Declarations, g: &dyn Graph) -> String {
    let id = |prefix: &str, name: &str| {
        let clean: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        format!("{prefix}_{clean}")
    };
    let mut out = String::new();
    g.open(&mut out);
    for e in plan.exchanges.iter().filter(|e| !is_internal(&e.name)) {
        g.exchange(&mut out, &id("x", &e.name), &format!("{} ({})", e.name, e.kind));
    }
    let has_work = plan.queues.iter().any(|q| q.role == Role::Work);
    if has_work {
        g.exchange(&mut out, "cascade", CASCADE);
    }
    for q in plan.queues.iter().filter(|q| q.role != Role::Delay) {
        g.queue(&mut out, &id("q", &q.name), &q.name);
    }
    for b in plan.bindings.iter().filter(|b| !is_internal(&b.source)) {
        if b.destination_kind == DestinationKind::Queue {
            g.edge(&mut out, &id("x", &b.source), &id("q", &b.destination), &b.routing_key, false);
        }
    }
    for q in plan.queues.iter().filter(|q| q.role == Role::Work) {
        if let Some(dlq) = q.arguments.get("x-dead-letter-routing-key").and_then(|v| v.as_str()) {
            g.edge(&mut out, &id("q", &q.name), &id("q", dlq), "dead-letter", true);
        }
        g.edge(&mut out, &id("q", &q.name), "cascade", "retry", true);
        g.edge(&mut out, "cascade", &id("q", &q.name), "after delay", true);
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

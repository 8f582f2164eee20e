//! Charts as inline SVG, drawn here so the page needs no script and no
//! network: a time axis (a stream's batches, a snapshot's waves) or a
//! category axis (reconcile runs), one kind of mark per chart.
//!
//! Every mark carries `class="mark"`, its value in `data-value` and a
//! `<title>` a reader sees on hover; the page's test finds the marks by that
//! class and checks the browser laid each one out where it can be seen.
//! A series longer than [`MAX_MARKS`] is cut into that many time buckets,
//! each drawn as its largest value (the title says how many it stands for),
//! so a table with a million batches still makes a page a browser opens.

use std::fmt::Write;

use chrono::{DateTime, Utc};

/// The most marks one chart draws.
pub const MAX_MARKS: usize = 1_000;

const WIDTH: f64 = 920.0;
const HEIGHT: f64 = 240.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 34.0;

/// How a chart draws its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marks {
    /// A bar from zero per value.
    Bars,
    /// A line through the values, a dot on each.
    Line,
}

/// One value of a series.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub at: DateTime<Utc>,
    pub value: f64,
    /// What the mark's title says besides the value and the time.
    pub note: String,
    /// A CSS class that colours the mark (e.g. `bad` for a failed run).
    pub tone: Option<&'static str>,
}

/// A vertical rule on a time chart: an event (a recovery, a skipped range).
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub at: DateTime<Utc>,
    pub label: String,
    pub tone: &'static str,
}

/// A chart of values over time.
pub struct TimeChart<'a> {
    /// The element id (the page's anchors and its test use it).
    pub id: &'a str,
    pub y_label: &'a str,
    pub marks: Marks,
    pub points: &'a [Point],
    pub rules: &'a [Rule],
}

/// A chart of one value per category, in the order given.
pub struct CategoryChart<'a> {
    pub id: &'a str,
    pub y_label: &'a str,
    /// (category label, value, title note, tone).
    pub bars: &'a [(String, f64, String, Option<&'static str>)],
}

/// Escapes text for HTML and SVG content and attributes.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// A value as people read it on an axis or in a title.
pub fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The smallest "round" number (1, 2 or 5 times a power of ten) at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
    if !(v > 0.0) || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= v * (1.0 - 1e-12) {
            return m * p;
        }
    }
    10.0 * p
}

/// Cuts a series longer than `max` into `max` time buckets, keeping each
/// bucket's largest value (ties: the first); a shorter one is returned as it is.
pub fn downsample(points: &[Point], max: usize) -> Vec<Point> {
    if points.len() <= max || max == 0 {
        return points.to_vec();
    }
    let (t0, t1) = span(points);
    let width = ((t1 - t0).num_microseconds().unwrap_or(i64::MAX) as f64 / max as f64).max(1.0);
    let mut buckets: Vec<Option<(Point, usize)>> = vec![None; max];
    for p in points {
        let off = (p.at - t0).num_microseconds().unwrap_or(0) as f64;
        let i = ((off / width) as usize).min(max - 1);
        match &mut buckets[i] {
            Some((best, n)) => {
                *n += 1;
                if p.value > best.value {
                    *best = p.clone();
                }
            }
            slot @ None => *slot = Some((p.clone(), 1)),
        }
    }
    buckets
        .into_iter()
        .flatten()
        .map(|(mut p, n)| {
            if n > 1 {
                p.note = format!("largest of {n} in this stretch; {}", p.note);
            }
            p
        })
        .collect()
}

fn span(points: &[Point]) -> (DateTime<Utc>, DateTime<Utc>) {
    let t0 = points.iter().map(|p| p.at).min().expect("a series with points");
    let t1 = points.iter().map(|p| p.at).max().expect("a series with points");
    (t0, t1)
}

fn time_label(t: DateTime<Utc>, span_seconds: f64) -> String {
    if span_seconds < 10.0 {
        // chrono knows %.3f, not %.1f: tenths are the milliseconds cut.
        let ms = t.format("%H:%M:%S%.3f").to_string();
        ms[..ms.len() - 2].to_string()
    } else if span_seconds < 600.0 {
        t.format("%H:%M:%S").to_string()
    } else if span_seconds < 2.0 * 86_400.0 {
        t.format("%H:%M").to_string()
    } else {
        t.format("%m-%d %H:%M").to_string()
    }
}

fn frame(out: &mut String, id: &str, y_label: &str, y_max: f64) {
    let _ = write!(
        out,
        r#"<svg class="chart" id="{id}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">"#,
        id = esc(id),
        label = esc(y_label)
    );
    let plot_h = HEIGHT - TOP - BOTTOM;
    for i in 0..=4 {
        let v = y_max * i as f64 / 4.0;
        let y = TOP + plot_h - plot_h * i as f64 / 4.0;
        let _ = write!(
            out,
            r#"<line class="grid" x1="{LEFT}" x2="{x2}" y1="{y:.1}" y2="{y:.1}"/><text class="tick" x="{tx}" y="{ty:.1}" text-anchor="end">{v}</text>"#,
            x2 = WIDTH - RIGHT,
            tx = LEFT - 6.0,
            ty = y + 4.0,
            v = fmt_value(v)
        );
    }
    let _ = write!(
        out,
        r#"<text class="axis-label" x="12" y="{y:.1}" transform="rotate(-90 12 {y:.1})" text-anchor="middle">{label}</text>"#,
        y = TOP + plot_h / 2.0,
        label = esc(y_label)
    );
}

/// The SVG of a time chart; `None` when it has no points.
pub fn time_chart(c: &TimeChart) -> Option<String> {
    if c.points.is_empty() {
        return None;
    }
    let points = downsample(c.points, MAX_MARKS);
    let (mut t0, mut t1) = span(&points);
    for r in c.rules {
        t0 = t0.min(r.at);
        t1 = t1.max(r.at);
    }
    // A single instant gets a minute around it, so its mark sits mid-chart.
    if t1 - t0 < chrono::Duration::seconds(1) {
        t0 -= chrono::Duration::seconds(30);
        t1 += chrono::Duration::seconds(30);
    }
    let span_us = (t1 - t0).num_microseconds().unwrap_or(i64::MAX) as f64;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    // Bars keep half a bar's width of margin at each end.
    let bar_w = match c.marks {
        Marks::Bars => (plot_w / (points.len() as f64 + 1.0) * 0.8).clamp(1.0, 24.0),
        Marks::Line => 0.0,
    };
    let inner_left = LEFT + bar_w;
    let inner_w = plot_w - 2.0 * bar_w;
    let x = |t: DateTime<Utc>| inner_left + inner_w * ((t - t0).num_microseconds().unwrap_or(0) as f64 / span_us);
    let y_max = nice_ceiling(points.iter().map(|p| p.value).fold(0.0, f64::max));
    let y = |v: f64| TOP + plot_h - plot_h * (v.max(0.0) / y_max);

    let mut out = String::new();
    frame(&mut out, c.id, c.y_label, y_max);
    let span_seconds = span_us / 1e6;
    for i in 0..=4 {
        let t = t0 + chrono::Duration::microseconds((span_us * i as f64 / 4.0) as i64);
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            out,
            r#"<text class="tick" x="{x:.1}" y="{y}" text-anchor="{anchor}">{label}</text>"#,
            x = x(t),
            y = HEIGHT - BOTTOM + 16.0,
            label = time_label(t, span_seconds)
        );
    }
    let _ = write!(out, r#"<text class="tick" x="{x}" y="{y}" text-anchor="end">UTC</text>"#, x = WIDTH - RIGHT, y = HEIGHT - 4.0);
    for r in c.rules {
        let _ = write!(
            out,
            r#"<line class="rule {tone}" x1="{x:.1}" x2="{x:.1}" y1="{TOP}" y2="{y2}"><title>{title}</title></line>"#,
            tone = r.tone,
            x = x(r.at),
            y2 = TOP + plot_h,
            title = esc(&format!("{} at {}", r.label, r.at.format("%Y-%m-%d %H:%M:%S UTC")))
        );
    }
    let title = |p: &Point| {
        let mut t = format!("{} at {}", fmt_value(p.value), p.at.format("%Y-%m-%d %H:%M:%S UTC"));
        if !p.note.is_empty() {
            t.push_str(" · ");
            t.push_str(&p.note);
        }
        esc(&t)
    };
    match c.marks {
        Marks::Bars => {
            for p in &points {
                // A zero keeps a hairline, so a batch that read nothing still shows.
                let top = y(p.value).min(TOP + plot_h - 1.0);
                let _ = write!(
                    out,
                    r#"<rect class="mark{tone}" data-value="{v}" x="{x:.2}" y="{top:.2}" width="{bar_w:.2}" height="{h:.2}"><title>{title}</title></rect>"#,
                    tone = p.tone.map(|t| format!(" {t}")).unwrap_or_default(),
                    v = p.value,
                    x = x(p.at) - bar_w / 2.0,
                    h = TOP + plot_h - top,
                    title = title(p)
                );
            }
        }
        Marks::Line => {
            let mut sorted = points.clone();
            sorted.sort_by_key(|p| p.at);
            let d: Vec<String> = sorted.iter().enumerate().map(|(i, p)| format!("{}{:.2},{:.2}", if i == 0 { 'M' } else { 'L' }, x(p.at), y(p.value))).collect();
            let _ = write!(out, r#"<path class="line" d="{}"/>"#, d.join(" "));
            for p in &sorted {
                let _ = write!(
                    out,
                    r#"<circle class="mark{tone}" data-value="{v}" cx="{x:.2}" cy="{y:.2}" r="3"><title>{title}</title></circle>"#,
                    tone = p.tone.map(|t| format!(" {t}")).unwrap_or_default(),
                    v = p.value,
                    x = x(p.at),
                    y = y(p.value),
                    title = title(p)
                );
            }
        }
    }
    out.push_str("</svg>");
    Some(out)
}

/// The SVG of a category chart; `None` when it has no bars.
pub fn category_chart(c: &CategoryChart) -> Option<String> {
    if c.bars.is_empty() {
        return None;
    }
    // The newest categories when there are too many to draw.
    let bars = &c.bars[c.bars.len().saturating_sub(MAX_MARKS)..];
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let slot = plot_w / bars.len() as f64;
    let bar_w = (slot * 0.7).clamp(1.0, 40.0);
    let y_max = nice_ceiling(bars.iter().map(|b| b.1).fold(0.0, f64::max));
    let y = |v: f64| TOP + plot_h - plot_h * (v.max(0.0) / y_max);
    let mut out = String::new();
    frame(&mut out, c.id, c.y_label, y_max);
    // Labels for at most about twenty categories, evenly spread.
    let every = bars.len().div_ceil(20).max(1);
    for (i, (label, v, note, tone)) in bars.iter().enumerate() {
        let cx = LEFT + slot * (i as f64 + 0.5);
        let top = y(*v).min(TOP + plot_h - 1.0);
        let mut title = format!("{label}: {}", fmt_value(*v));
        if !note.is_empty() {
            title.push_str(" · ");
            title.push_str(note);
        }
        let _ = write!(
            out,
            r#"<rect class="mark{tone}" data-value="{v}" x="{x:.2}" y="{top:.2}" width="{bar_w:.2}" height="{h:.2}"><title>{title}</title></rect>"#,
            tone = tone.map(|t| format!(" {t}")).unwrap_or_default(),
            x = cx - bar_w / 2.0,
            h = TOP + plot_h - top,
            title = esc(&title)
        );
        if i % every == 0 {
            let _ = write!(out, r#"<text class="tick" x="{cx:.1}" y="{y}" text-anchor="middle">{l}</text>"#, y = HEIGHT - BOTTOM + 16.0, l = esc(label));
        }
    }
    out.push_str("</svg>");
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_790_000_000 + s, 0).unwrap()
    }

    fn p(s: i64, v: f64) -> Point {
        Point { at: at(s), value: v, note: String::new(), tone: None }
    }

    #[test]
    fn round_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(10.0), 10.0);
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(430.0), 500.0);
        assert_eq!(nice_ceiling(0.03), 0.05);
    }

    #[test]
    fn a_long_series_keeps_each_buckets_largest_value() {
        let pts: Vec<Point> = (0..10_000).map(|i| p(i, (i % 97) as f64)).collect();
        let d = downsample(&pts, 100);
        assert_eq!(d.len(), 100);
        // Every bucket of 100 seconds holds a 96 (i % 97 runs through 0..97 within 100 values).
        assert!(d.iter().all(|q| q.value == 96.0), "{:?}", d.iter().map(|q| q.value).collect::<Vec<_>>());
        assert!(d.iter().all(|q| q.note.starts_with("largest of ")));
        let short: Vec<Point> = (0..5).map(|i| p(i, 1.0)).collect();
        assert_eq!(downsample(&short, 100), short);
    }

    #[test]
    fn every_point_is_one_mark_with_its_value_and_bars_stay_inside_the_plot() {
        let pts = vec![p(0, 0.0), p(60, 12.5), p(120, 20.0)];
        let svg = time_chart(&TimeChart { id: "c", y_label: "rows", marks: Marks::Bars, points: &pts, rules: &[] }).unwrap();
        assert_eq!(svg.matches(r#"class="mark""#).count(), 3);
        for v in ["0", "12.5", "20"] {
            assert!(svg.contains(&format!(r#"data-value="{v}""#)), "{svg}");
        }
        // The largest value (a round one) reaches the top of the plot, a zero
        // keeps a hairline at the bottom.
        assert!(svg.contains(&format!(r#"y="{TOP:.2}""#)), "{svg}");
        assert!(svg.contains(r#"height="1.00""#), "{svg}");
        let line = time_chart(&TimeChart { id: "l", y_label: "s", marks: Marks::Line, points: &pts, rules: &[Rule { at: at(30), label: "recovery".into(), tone: "bad" }] }).unwrap();
        assert_eq!(line.matches("<circle").count(), 3);
        assert_eq!(line.matches(r#"class="rule bad""#).count(), 1);
        assert!(time_chart(&TimeChart { id: "e", y_label: "s", marks: Marks::Line, points: &[], rules: &[] }).is_none());
    }

    #[test]
    fn time_labels_fit_the_span() {
        let sub = |ms: i64| Point { at: at(0) + chrono::Duration::milliseconds(ms), value: 1.0, note: String::new(), tone: None };
        for (span_ms, label) in [(2_500, ">14:13:20.0<"), (300_000, ">14:13:20<"), (7_200_000, ">14:13<"), (5 * 86_400_000, ">09-21 14:13<")] {
            let pts = vec![sub(0), sub(span_ms)];
            let svg = time_chart(&TimeChart { id: "t", y_label: "s", marks: Marks::Line, points: &pts, rules: &[] }).unwrap();
            assert!(svg.contains(label), "{span_ms} ms: {svg}");
        }
    }

    #[test]
    fn text_is_escaped() {
        let bars = vec![("<run 1>".to_string(), 2.0, "a & b".to_string(), Some("bad"))];
        let svg = category_chart(&CategoryChart { id: "r", y_label: "differences", bars: &bars }).unwrap();
        assert!(svg.contains("&lt;run 1&gt;") && svg.contains("a &amp; b") && !svg.contains("<run 1>"));
        assert!(svg.contains(r#"class="mark bad""#));
    }
}

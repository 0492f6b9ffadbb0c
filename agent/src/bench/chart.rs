//! The benchmark chart: one horizontal bar per row (its median), a whisker to its p90, on a
//! logarithmic millisecond axis — SVG, rendered with `plotters` (no font or system
//! libraries: text is left to the SVG viewer).

use plotters::prelude::*;

use super::BenchError;

/// One bar of the chart.
pub struct Bar<'a> {
    pub name: &'a str,
    pub median_ms: f64,
    pub p90_ms: f64,
    /// Drawn in the reference colour (the bubblewrap rows).
    pub reference: bool,
}

/// A vertical marker (a target) at `ms`, labelled.
pub struct Mark<'a> {
    pub ms: f64,
    pub label: &'a str,
}

/// The chart, as SVG text (written by the caller, whole: see [`crate::whole_file`]).
pub fn render(title: &str, bars: &[Bar], marks: &[Mark]) -> Result<String, BenchError> {
    let err = |e: &dyn std::fmt::Display| BenchError::Failed(format!("chart: {e}"));
    if bars.is_empty() {
        return Err(err(&"no rows to draw"));
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let lo = bars.iter().map(|b| b.median_ms).filter(|x| positive(*x)).fold(f64::INFINITY, f64::min);
    let hi = bars.iter().map(|b| b.p90_ms.max(b.median_ms)).filter(|x| positive(*x)).fold(0.0, f64::max);
    if !positive(lo) || !positive(hi) {
        return Err(err(&"no positive timings to draw"));
    }
    // Whole decades around the data.
    let (x0, x1) = (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil()).max(lo * 10.0));
    let height = 120 + 34 * bars.len() as u32;
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = bars.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d((x0..x1).log_scale(), -0.5f64..(n as f64 - 0.5))
        .map_err(|e| err(&e))?;
    let label = |y: &f64| -> String {
        let i = y.round();
        if (y - i).abs() > 1e-6 || i < 0.0 {
            return String::new();
        }
        // Row 0 at the top.
        bars.get(n.saturating_sub(1 + i as usize)).map_or(String::new(), |b| b.name.to_string())
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&label)
        .x_desc("milliseconds (log scale): bar = median, whisker = p90")
        .x_label_formatter(&|x| {
            if *x >= 1.0 {
                format!("{x:.0}")
            } else {
                format!("{x}")
            }
        })
        .draw()
        .map_err(|e| err(&e))?;
    let plain = RGBColor(70, 110, 170);
    let reference = RGBColor(200, 120, 40);
    for (i, b) in bars.iter().enumerate() {
        let y = (n - 1 - i) as f64;
        let colour = if b.reference { reference } else { plain };
        let median = b.median_ms.max(x0);
        chart
            .draw_series(std::iter::once(Rectangle::new([(x0, y - 0.32), (median, y + 0.32)], colour.filled())))
            .map_err(|e| err(&e))?;
        let p90 = b.p90_ms.max(median);
        chart
            .draw_series([
                PathElement::new(vec![(median, y), (p90, y)], BLACK.stroke_width(1)),
                PathElement::new(vec![(p90, y - 0.18), (p90, y + 0.18)], BLACK.stroke_width(1)),
            ])
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{:.2}", b.median_ms),
                (p90 * 1.06, y - 0.12),
                ("sans-serif", 12),
            )))
            .map_err(|e| err(&e))?;
    }
    let red = RGBColor(190, 30, 30);
    for m in marks.iter().filter(|m| m.ms > x0 && m.ms < x1) {
        let top = n as f64 - 0.5;
        chart
            .draw_series([PathElement::new(vec![(m.ms, -0.5), (m.ms, top)], red.stroke_width(1))])
            .map_err(|e| err(&e))?;
        chart
            .draw_series(std::iter::once(Text::new(
                m.label.to_string(),
                (m.ms * 1.04, top - 0.1),
                ("sans-serif", 11).into_font().color(&red),
            )))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    drop(chart);
    drop(root);
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_well_formed_svg() {
        let bars = [
            Bar { name: "true", median_ms: 0.7, p90_ms: 0.9, reference: false },
            Bar { name: "bwrap-true", median_ms: 3.9, p90_ms: 4.5, reference: true },
            Bar { name: "run-cold", median_ms: 21.0, p90_ms: 30.0, reference: false },
        ];
        let text = render("t", &bars, &[Mark { ms: 2.0, label: "target" }]).unwrap();
        assert!(text.trim_start().starts_with("<svg") && text.trim_end().ends_with("</svg>"));
        assert!(text.contains("bwrap-true") && text.contains("run-cold"));
    }

    #[test]
    fn refuses_nothing_to_draw() {
        assert!(render("t", &[], &[]).is_err());
        let bars = [Bar { name: "x", median_ms: 0.0, p90_ms: 0.0, reference: false }];
        assert!(render("t", &bars, &[]).is_err());
    }
}

//! The sweep's plot: p90 normalized latency against throughput per mode, and mean TTFT by turn
//! index, drawn from the summaries or read back from the CSV files (`--replot`).

use std::path::Path;

use plotters::prelude::*;

use crate::report::{Summary, CSV_COLUMNS};
use crate::AnyResult;
use pensieve::cli::Mode;

/// What the plot needs of one run; from a [`Summary`] or read back from the CSV files.
pub(crate) struct PlotPoint {
    pub(crate) mode: String,
    pub(crate) turns_per_s: f64,
    pub(crate) norm_latency_ms_p90: f64,
    pub(crate) ttft_ms_by_turn: Vec<f64>,
}

impl From<&Summary> for PlotPoint {
    fn from(s: &Summary) -> Self {
        Self {
            mode: s.mode.to_string(),
            turns_per_s: s.turns_per_s,
            norm_latency_ms_p90: s.norm_latency_ms_p90,
            ttft_ms_by_turn: s.ttft_ms_by_turn.clone(),
        }
    }
}

/// Reads `sweep.csv` and `ttft_by_turn.csv` from `dir` (as [`write_csv`] writes them).
pub(crate) fn read_points(dir: &Path) -> AnyResult<Vec<PlotPoint>> {
    let read = |name: &str| -> AnyResult<Vec<Vec<String>>> {
        let text = std::fs::read_to_string(dir.join(name))?;
        Ok(text
            .lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split(',').map(str::to_string).collect())
            .collect())
    };
    let column = |name: &str| CSV_COLUMNS.iter().position(|c| *c == name);
    let (Some(turns_per_s), Some(norm)) = (column("turns_per_s"), column("norm_latency_ms_p90"))
    else {
        return Err("sweep.csv columns changed".into());
    };
    let by_turn = read("ttft_by_turn.csv")?;
    let mut points = Vec::new();
    for row in read("sweep.csv")? {
        let field = |i: usize| row.get(i).cloned().unwrap_or_default();
        points.push(PlotPoint {
            mode: field(0),
            turns_per_s: field(turns_per_s).parse()?,
            norm_latency_ms_p90: field(norm).parse()?,
            ttft_ms_by_turn: Vec::new(),
        });
        let key = row.get(..3).unwrap_or_default().to_vec();
        for t in &by_turn {
            if t.get(..3) == Some(&key[..])
                && let (Some(p), Some(v)) = (points.last_mut(), t.get(4))
            {
                p.ttft_ms_by_turn.push(v.parse()?);
            }
        }
    }
    Ok(points)
}

/// Plot colour of a mode: red, orange, blue as in the papers' figures.
pub(crate) fn color(mode: &str) -> RGBColor {
    match mode {
        "stateless" => RGBColor(214, 39, 40),
        "device-only" => RGBColor(255, 127, 14),
        _ => RGBColor(31, 119, 180),
    }
}

/// Left: p90 normalized latency against throughput per mode (the papers' Figure 8). Right:
/// mean TTFT by turn index per mode at the lightest load.
pub(crate) fn plot(path: &Path, summaries: &[PlotPoint]) -> AnyResult<()> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(700);
    let finite = |v: f64| v.is_finite() && v > 0.0;
    let x_max = summaries.iter().map(|s| s.turns_per_s).fold(0.0, f64::max) * 1.1;
    let y_max = summaries
        .iter()
        .map(|s| s.norm_latency_ms_p90)
        .filter(|&v| finite(v))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&left)
        .caption("p90 normalized latency vs throughput", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max.max(1e-3), 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("throughput (turns/s)")
        .y_desc("p90 latency per output token (ms)")
        .draw()?;
    for mode in Mode::ALL {
        let pts: Vec<(f64, f64)> = summaries
            .iter()
            .filter(|s| s.mode == mode.name() && finite(s.norm_latency_ms_p90))
            .map(|s| (s.turns_per_s, s.norm_latency_ms_p90))
            .collect();
        draw_mode(&mut chart, mode.name(), pts)?;
    }
    draw_legend(&mut chart)?;

    let lightest: Vec<&PlotPoint> = Mode::ALL
        .iter()
        .filter_map(|m| {
            summaries
                .iter()
                .filter(|s| s.mode == m.name())
                .min_by(|a, b| a.turns_per_s.total_cmp(&b.turns_per_s))
        })
        .collect();
    let turns = lightest
        .iter()
        .map(|s| s.ttft_ms_by_turn.len())
        .max()
        .unwrap_or(1);
    let t_max = lightest
        .iter()
        .flat_map(|s| s.ttft_ms_by_turn.iter().copied())
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "mean TTFT by turn index (lightest load)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.5..turns as f64 + 0.5, 0.0..t_max)?;
    chart
        .configure_mesh()
        .x_desc("turn index")
        .y_desc("mean TTFT (ms)")
        .draw()?;
    for s in &lightest {
        let pts: Vec<(f64, f64)> = s
            .ttft_ms_by_turn
            .iter()
            .enumerate()
            .map(|(k, &v)| ((k + 1) as f64, v))
            .collect();
        draw_mode(&mut chart, &s.mode, pts)?;
    }
    draw_legend(&mut chart)?;
    root.present()?;
    Ok(())
}

pub(crate) type Chart<'a, 'b, X, Y> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<X, Y>>;

/// One mode's line with its points, in the mode's colour, labelled for the legend.
pub(crate) fn draw_mode<X, Y>(
    chart: &mut Chart<'_, '_, X, Y>,
    mode: &str,
    pts: Vec<(f64, f64)>,
) -> AnyResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let color = color(mode);
    chart
        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
        .label(mode.to_string())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    Ok(())
}

pub(crate) fn draw_legend<'a, X, Y>(chart: &mut Chart<'a, 'a, X, Y>) -> AnyResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

//! Drives the engine in real time: submits each turn when it is due, steps while there is work,
//! sleeps until the next turn is due otherwise.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use pensieve::engine::{
    ConversationId, ConversationOptions, Engine, Event, FinishReason, RequestId, SamplingParams,
    Turn, TurnStats,
};
use pensieve::workload::ConversationSpec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{AnyResult, Load};

/// Start times in seconds: the trace's own, else Poisson arrivals at the load's rate (closed
/// loop starts conversations as others end, so its times are unused).
pub(crate) fn arrivals(workload: &[ConversationSpec], load: Load, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let rate = match load {
        Load::Open { rate, .. } => rate.max(1e-9),
        Load::Closed { .. } => 1.0,
    };
    let mut t = 0.0;
    workload
        .iter()
        .map(|c| {
            let poisson = t;
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            c.arrival_s.unwrap_or(poisson)
        })
        .collect()
}

/// A finished turn.
pub(crate) struct TurnRecord {
    pub(crate) turn_index: usize,
    pub(crate) stats: TurnStats,
}

/// What one replay produced.
pub(crate) struct Run {
    pub(crate) records: Vec<TurnRecord>,
    pub(crate) failed: usize,
    pub(crate) conversations: usize,
    pub(crate) wall: Duration,
}

/// A conversation's place in the replay.
struct Progress {
    conv: Option<ConversationId>,
    next_turn: usize,
}

/// One replay in progress.
struct Driver<'a> {
    engine: &'a mut Engine,
    workload: &'a [ConversationSpec],
    load: Load,
    /// Replies end at the model's end of turn (else they run to the trace's length).
    stop_at_eos: bool,
    bar: &'a ProgressBar,
    start: Instant,
    /// Due times in nanoseconds from the start, with the conversation index.
    due: BinaryHeap<Reverse<(u128, usize)>>,
    /// Closed loop: the next conversation to start when one ends.
    next_new: usize,
    state: Vec<Progress>,
    live: HashMap<RequestId, usize>,
    run: Run,
}

/// Replays `workload` with conversations starting at `arrivals` (open loop) or as others end
/// (closed loop).
pub(crate) fn replay(
    engine: &mut Engine,
    workload: &[ConversationSpec],
    arrivals: &[f64],
    (load, stop_at_eos): (Load, bool),
    bar: &ProgressBar,
) -> AnyResult<Run> {
    let mut due = BinaryHeap::new();
    let next_new = match load {
        Load::Open { .. } => {
            for (i, &a) in arrivals.iter().enumerate() {
                due.push(Reverse(((a * 1e9) as u128, i)));
            }
            workload.len()
        }
        Load::Closed { concurrency } => {
            let n = concurrency.clamp(1, workload.len());
            due.extend((0..n).map(|i| Reverse((0, i))));
            n
        }
    };
    let mut d = Driver {
        engine,
        workload,
        load,
        stop_at_eos,
        bar,
        start: Instant::now(),
        due,
        next_new,
        state: workload
            .iter()
            .map(|_| Progress {
                conv: None,
                next_turn: 0,
            })
            .collect(),
        live: HashMap::new(),
        run: Run {
            records: Vec::new(),
            failed: 0,
            conversations: 0,
            wall: Duration::ZERO,
        },
    };
    loop {
        d.submit_due()?;
        if d.engine.has_work() {
            for event in d.engine.step()? {
                if let Event::Finished {
                    request,
                    reason,
                    stats,
                    ..
                } = event
                {
                    d.on_finished(request, reason, stats)?;
                }
            }
        } else if let Some(&Reverse((t, _))) = d.due.peek() {
            let now = d.now();
            std::thread::sleep(Duration::from_nanos(t.saturating_sub(now) as u64));
        } else {
            break;
        }
    }
    Ok(d.run)
}

impl Driver<'_> {
    fn now(&self) -> u128 {
        self.start.elapsed().as_nanos()
    }

    /// Submits every turn that is due.
    fn submit_due(&mut self) -> AnyResult<()> {
        let now = self.now();
        while let Some(&Reverse((t, i))) = self.due.peek() {
            if t > now {
                break;
            }
            self.due.pop();
            match self.submit_next(i)? {
                Some(id) => {
                    self.live.insert(id, i);
                }
                None => {
                    let left = self.workload[i].turns.len() - self.state[i].next_turn;
                    self.bar.inc(left as u64);
                    self.end_conversation(i)?;
                }
            }
        }
        Ok(())
    }

    /// Submits conversation `i`'s next turn; `None` when it would not fit the context window
    /// (the conversation ends there) or the engine refuses it.
    fn submit_next(&mut self, i: usize) -> AnyResult<Option<RequestId>> {
        let spec = &self.workload[i];
        let p = &mut self.state[i];
        let conv = match p.conv {
            Some(c) => c,
            None => *p
                .conv
                .insert(self.engine.open(ConversationOptions::default())?),
        };
        let turn = &spec.turns[p.next_turn];
        let refused = |e: &dyn std::fmt::Display| {
            eprintln!("conversation {} turn {}: {e}", spec.id, p.next_turn + 1);
        };
        let user = Turn::user(turn.user.clone());
        match self.engine.turn_size(conv, user.clone()) {
            Ok(size) if size.max_reply_tokens >= turn.output_tokens => {}
            Ok(_) => return Ok(None),
            Err(e) => {
                refused(&e);
                return Ok(None);
            }
        }
        let params = SamplingParams::greedy()
            .max_tokens(turn.output_tokens)
            .ignore_eos(!self.stop_at_eos);
        match self.engine.submit(conv, user, params) {
            Ok(id) => Ok(Some(id)),
            Err(e) => {
                refused(&e);
                Ok(None)
            }
        }
    }

    /// Records a finished turn and schedules the conversation's next one after the think time.
    fn on_finished(
        &mut self,
        request: RequestId,
        reason: FinishReason,
        stats: TurnStats,
    ) -> AnyResult<()> {
        let Some(i) = self.live.remove(&request) else {
            return Ok(());
        };
        self.bar.inc(1);
        let turns = self.workload[i].turns.len();
        let p = &mut self.state[i];
        if !matches!(reason, FinishReason::Length | FinishReason::Stop) {
            eprintln!(
                "conversation {} turn {}: {reason:?}",
                self.workload[i].id,
                p.next_turn + 1
            );
            self.run.failed += 1;
            self.bar.inc((turns - p.next_turn - 1) as u64);
            return self.end_conversation(i);
        }
        let think = match self.load {
            Load::Open { think_scale, .. } => {
                (0.1 * stats.output_tokens as f64).max(5.0) * think_scale
            }
            Load::Closed { .. } => 0.0,
        };
        self.run.records.push(TurnRecord {
            turn_index: p.next_turn,
            stats,
        });
        self.run.wall = self.start.elapsed();
        p.next_turn += 1;
        if p.next_turn < turns {
            let at = self.now() + (think * 1e9) as u128;
            self.due.push(Reverse((at, i)));
            return Ok(());
        }
        self.end_conversation(i)
    }

    /// Closes conversation `i`; the closed loop starts a new one in its place.
    fn end_conversation(&mut self, i: usize) -> AnyResult<()> {
        if let Some(c) = self.state[i].conv.take() {
            self.engine.close(c)?;
            self.run.conversations += 1;
        }
        if matches!(self.load, Load::Closed { .. }) && self.next_new < self.workload.len() {
            self.due.push(Reverse((self.now(), self.next_new)));
            self.next_new += 1;
        }
        Ok(())
    }
}

//! The scheduler: a [`FilterConfig`] compiled into plugin instances, and one
//! scheduling cycle per request. A cycle runs the profile handler, which runs
//! profiles (filters → weighted scorers → picker) through [`Cycle`], which
//! records everything in the trace. Invariants enforced here, whatever a
//! plugin does: a route only names endpoints that survived the filters of the
//! profile that chose them; scores enter the totals clamped to [0, 1].
//!
//! The full trace copies every plugin and endpoint name, which costs more
//! than the decision itself on a small fleet; [`Scheduler::schedule_with`]
//! with [`TraceLevel::Summary`] records only the handler's reason, for callers
//! that print nothing more (the proxy's request path unless debug logging is
//! on). A summary cycle whose filters leave exactly one candidate skips the
//! scorers: scores cannot change a one-candidate ranking, and scorers learn
//! only in `post_decision`, which still runs. Filters and the picker always
//! run, so the decision, its errors and stateful pickers are the same.

use std::sync::Arc;

use crate::sched::config::FilterConfig;
use crate::sched::decision::{
    Choice, Decision, DecisionTrace, FilterTrace, ProfileTrace, Route, ScorerTrace,
};
use crate::sched::error::{ConfigError, ConfigErrorKind, ScheduleError};
use crate::sched::plugin::{
    Filter, HandlerOutcome, PickCtx, Picker, ProfileHandler, ProfileResult, ProfileRunner,
    SchedRng, Scorer,
};
use crate::sched::registry::{Plugin, PluginRegistry};
use crate::sched::view::{EndpointView, RequestView};

/// How much of the [`DecisionTrace`] a cycle records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceLevel {
    /// Every profile, filter, scorer and candidate (logs, `/debug/route`).
    Full,
    /// Only [`DecisionTrace::reason`]; the other fields are empty.
    Summary,
}

/// A compiled filter config. Cheap to share (`Arc`) across request tasks;
/// stateful plugins use interior locking.
pub struct Scheduler {
    profiles: Vec<Profile>,
    handler: Arc<dyn ProfileHandler>,
    handler_name: String,
    /// Every distinct scorer instance, for the post-decision hook.
    learners: Vec<Arc<dyn Scorer>>,
}

struct Profile {
    name: String,
    filters: Vec<(String, Arc<dyn Filter>)>,
    scorers: Vec<(String, f64, Arc<dyn Scorer>)>,
    picker: (String, Arc<dyn Picker>),
}

impl Scheduler {
    /// Compile `cfg` with the built-in plugins.
    pub fn new(cfg: &FilterConfig) -> Result<Scheduler, ConfigError> {
        Scheduler::with_registry(cfg, &PluginRegistry::builtin())
    }

    /// Compile `cfg` with a custom registry.
    pub fn with_registry(
        cfg: &FilterConfig,
        registry: &PluginRegistry,
    ) -> Result<Scheduler, ConfigError> {
        let mut built = cfg.build(registry)?.by_name;
        let errs = cfg.errs();
        let wrong = |name: &str, what: &str| {
            errs.at(
                "plugins",
                ConfigErrorKind::Invalid,
                format!("plugin {name:?} is not a {what}"),
            )
        };
        let mut learners: Vec<(String, Arc<dyn Scorer>)> = Vec::new();
        let mut profiles = Vec::with_capacity(cfg.profiles.len());
        for spec in &cfg.profiles {
            let mut filters = Vec::new();
            for f in &spec.filters {
                match built.get(f) {
                    Some(Plugin::Filter(p)) => filters.push((f.clone(), p.clone())),
                    _ => return Err(wrong(f, "filter")),
                }
            }
            let mut scorers = Vec::new();
            for (s, w) in &spec.scorers {
                match built.get(s) {
                    Some(Plugin::Scorer(p)) => {
                        if !learners.iter().any(|(n, _)| n == s) {
                            learners.push((s.clone(), p.clone()));
                        }
                        scorers.push((s.clone(), *w, p.clone()));
                    }
                    _ => return Err(wrong(s, "scorer")),
                }
            }
            let picker = match built.get(&spec.picker) {
                Some(Plugin::Picker(p)) => (spec.picker.clone(), p.clone()),
                _ => return Err(wrong(&spec.picker, "picker")),
            };
            profiles.push(Profile {
                name: spec.name.clone(),
                filters,
                scorers,
                picker,
            });
        }
        let handler = match built.remove(&cfg.handler) {
            Some(Plugin::ProfileHandler(h)) => h,
            _ => return Err(wrong(&cfg.handler, "profile handler")),
        };
        for p in handler.profiles() {
            if !profiles.iter().any(|q| q.name == p) {
                return Err(errs.at(
                    "schedulingProfiles",
                    ConfigErrorKind::DanglingRef,
                    format!("handler {:?} needs profile {p:?}", cfg.handler),
                ));
            }
        }
        Ok(Scheduler {
            profiles,
            handler,
            handler_name: cfg.handler.clone(),
            learners: learners.into_iter().map(|(_, s)| s).collect(),
        })
    }

    /// Choose where `req` goes among `endpoints`. The same inputs and seed
    /// give the same decision. Stateful plugins (e.g. `no-hit-lru-scorer`,
    /// `round-robin-picker`) learn from it.
    pub fn schedule(
        &self,
        req: &RequestView,
        endpoints: &[EndpointView],
        now_ms: u64,
        rng_seed: u64,
    ) -> Result<Decision, ScheduleError> {
        self.schedule_with(req, endpoints, now_ms, rng_seed, TraceLevel::Full)
    }

    /// [`Scheduler::schedule`] recording only as much trace as `level` says;
    /// the route, errors and plugin state are the same at every level.
    pub fn schedule_with(
        &self,
        req: &RequestView,
        endpoints: &[EndpointView],
        now_ms: u64,
        rng_seed: u64,
        level: TraceLevel,
    ) -> Result<Decision, ScheduleError> {
        let (route, trace) = self.cycle(req, endpoints, rng_seed, false, level);
        let route = route?;
        for s in &self.learners {
            s.post_decision(req, endpoints, &route, now_ms);
        }
        Ok(Decision { route, trace })
    }

    /// What [`Scheduler::schedule`] would decide, and why, without changing
    /// any plugin state: for `/debug/route`. The trace is returned even when
    /// no endpoint is left (it then says which filter emptied the set).
    pub fn explain(
        &self,
        req: &RequestView,
        endpoints: &[EndpointView],
        rng_seed: u64,
    ) -> (Result<Route, ScheduleError>, DecisionTrace) {
        self.cycle(req, endpoints, rng_seed, true, TraceLevel::Full)
    }

    /// The configured profile names.
    pub fn profile_names(&self) -> impl Iterator<Item = &str> {
        self.profiles.iter().map(|p| p.name.as_str())
    }

    fn cycle(
        &self,
        req: &RequestView,
        endpoints: &[EndpointView],
        rng_seed: u64,
        dry_run: bool,
        level: TraceLevel,
    ) -> (Result<Route, ScheduleError>, DecisionTrace) {
        let mut cycle = Cycle {
            sched: self,
            req,
            endpoints,
            pick: PickCtx {
                rng: SchedRng::new(rng_seed),
                dry_run,
            },
            full: level == TraceLevel::Full,
            traces: Vec::new(),
        };
        let outcome = self.handler.handle(&mut cycle, req, endpoints);
        let mut trace = match level {
            TraceLevel::Full => DecisionTrace {
                request_id: req.request_id.clone(),
                model: req.model.clone(),
                handler: self.handler_name.clone(),
                reason: String::new(),
                profiles: cycle.traces,
            },
            TraceLevel::Summary => DecisionTrace {
                request_id: String::new(),
                model: String::new(),
                handler: String::new(),
                reason: String::new(),
                profiles: Vec::new(),
            },
        };
        let route = outcome.and_then(|o| match o {
            HandlerOutcome::Aggregated { ranked, reason } => {
                trace.reason = reason;
                Ok(Route::Aggregated {
                    target: choice(req, endpoints, &ranked)?,
                })
            }
            HandlerOutcome::Disaggregated {
                prefill,
                decode,
                reason,
            } => {
                trace.reason = reason;
                Ok(Route::Disaggregated {
                    prefill: choice(req, endpoints, &prefill)?,
                    decode: choice(req, endpoints, &decode)?,
                })
            }
        });
        if let Err(e) = &route {
            trace.reason = e.to_string();
        }
        (route, trace)
    }
}

/// A ranked index list as a choice; an empty or out-of-range list (a broken
/// plugin) becomes `NoEndpoint` rather than a panic.
fn choice(
    req: &RequestView,
    eps: &[EndpointView],
    ranked: &[usize],
) -> Result<Choice, ScheduleError> {
    let no = || ScheduleError::NoEndpoint {
        model: req.model.clone(),
        filter: "<picker returned nothing>".to_owned(),
        profile: String::new(),
    };
    let (&first, rest) = ranked.split_first().ok_or_else(no)?;
    let ep = eps.get(first).ok_or_else(no)?;
    Ok(Choice {
        id: ep.id.clone(),
        index: first,
        fallbacks: rest
            .iter()
            .filter_map(|&i| eps.get(i))
            .map(|e| e.id.clone())
            .collect(),
    })
}

/// One request's scheduling cycle; runs profiles for the handler.
struct Cycle<'a> {
    sched: &'a Scheduler,
    req: &'a RequestView,
    endpoints: &'a [EndpointView],
    pick: PickCtx,
    /// Record the full trace ([`TraceLevel::Full`]).
    full: bool,
    traces: Vec<ProfileTrace>,
}

impl ProfileRunner for Cycle<'_> {
    fn run(&mut self, name: &str) -> Result<ProfileResult, ScheduleError> {
        let Some(prof) = self.sched.profiles.iter().find(|p| p.name == name) else {
            return Err(ScheduleError::UnknownProfile(name.to_owned()));
        };
        if !self.full {
            return self.run_summary(prof);
        }
        let (req, eps) = (self.req, self.endpoints);
        let mut trace = ProfileTrace {
            profile: prof.name.clone(),
            endpoints_in: eps.len(),
            filters: Vec::with_capacity(prof.filters.len()),
            emptied_by: None,
            candidates: Vec::new(),
            scorers: Vec::with_capacity(prof.scorers.len()),
            totals: Vec::new(),
            picker: prof.picker.0.clone(),
            picked: Vec::new(),
        };
        let filtered = filter_candidates(req, eps, prof, |fname, removed| {
            trace.filters.push(FilterTrace {
                filter: fname.to_owned(),
                removed: removed.iter().map(|&i| eps[i].id.clone()).collect(),
            });
        });
        let cands = match filtered {
            Ok(cands) => cands,
            Err(e) => {
                if let ScheduleError::NoEndpoint { filter, .. } = &e {
                    trace.emptied_by = Some(filter.clone());
                }
                self.traces.push(trace);
                return Err(e);
            }
        };
        let n = cands.len();
        let mut totals = vec![0.0; n];
        for (sname, weight, s) in &prof.scorers {
            let mut scores = vec![0.0; n];
            add_scores(
                req,
                eps,
                &cands,
                s.as_ref(),
                *weight,
                &mut scores,
                &mut totals,
            );
            trace.scorers.push(ScorerTrace {
                scorer: sname.clone(),
                weight: *weight,
                scores,
            });
        }
        let ranked = self.pick(prof, &cands, &totals);
        trace.candidates = cands.iter().map(|&i| eps[i].id.clone()).collect();
        trace.picked = ranked.iter().map(|&i| eps[i].id.clone()).collect();
        trace.totals = totals;
        self.traces.push(trace);
        Ok(ProfileResult { ranked })
    }
}

impl Cycle<'_> {
    /// [`ProfileRunner::run`] without a trace: the same filters, scorers
    /// (skipped when one candidate is left, see the module docs) and picker.
    fn run_summary(&mut self, prof: &Profile) -> Result<ProfileResult, ScheduleError> {
        let (req, eps) = (self.req, self.endpoints);
        let cands = filter_candidates(req, eps, prof, |_, _| {})?;
        let n = cands.len();
        let mut totals = vec![0.0; n];
        if n > 1 {
            let mut scores = vec![0.0; n];
            for (_, weight, s) in &prof.scorers {
                scores.fill(0.0);
                add_scores(
                    req,
                    eps,
                    &cands,
                    s.as_ref(),
                    *weight,
                    &mut scores,
                    &mut totals,
                );
            }
        }
        let ranked = self.pick(prof, &cands, &totals);
        Ok(ProfileResult { ranked })
    }

    /// The picker's ranking as endpoint indices (see [`valid_positions`]).
    fn pick(&mut self, prof: &Profile, cands: &[usize], totals: &[f64]) -> Vec<usize> {
        let mut picked = Vec::new();
        prof.picker
            .1
            .pick(&mut self.pick, self.endpoints, cands, totals, &mut picked);
        valid_positions(&picked, totals)
            .into_iter()
            .map(|p| cands[p])
            .collect()
    }
}

/// Runs one scorer into `scores` (clamped to [0, 1], NaN as 0) and adds its
/// weighted scores to `totals`.
fn add_scores(
    req: &RequestView,
    eps: &[EndpointView],
    cands: &[usize],
    s: &dyn Scorer,
    weight: f64,
    scores: &mut [f64],
    totals: &mut [f64],
) {
    s.score(req, eps, cands, scores);
    for (t, sc) in totals.iter_mut().zip(scores.iter_mut()) {
        *sc = if sc.is_nan() { 0.0 } else { sc.clamp(0.0, 1.0) };
        *t += weight * *sc;
    }
}

/// Make `after` the entries of `before` it kept (in `before`'s order, so a
/// filter cannot add or reorder), and return those removed.
/// Runs `prof`'s filters in order over every endpoint: the candidates left, or
/// `NoEndpoint` naming the filter that removed the last one (`<no endpoints>`
/// when there were none). `removed` hears each filter's name and the
/// endpoints it took out (empty when none), for the full trace.
fn filter_candidates(
    req: &RequestView,
    eps: &[EndpointView],
    prof: &Profile,
    mut removed: impl FnMut(&str, &[usize]),
) -> Result<Vec<usize>, ScheduleError> {
    let none_left = |filter: &str| ScheduleError::NoEndpoint {
        model: req.model.clone(),
        filter: filter.to_owned(),
        profile: prof.name.clone(),
    };
    let mut cands: Vec<usize> = (0..eps.len()).collect();
    if cands.is_empty() {
        return Err(none_left("<no endpoints>"));
    }
    let mut before = Vec::with_capacity(cands.len());
    for (fname, f) in &prof.filters {
        before.clear();
        before.extend_from_slice(&cands);
        f.filter(req, eps, &mut cands);
        removed(fname, &keep_subsequence(&before, &mut cands));
        if cands.is_empty() {
            return Err(none_left(fname));
        }
    }
    Ok(cands)
}

fn keep_subsequence(before: &[usize], after: &mut Vec<usize>) -> Vec<usize> {
    // The usual case, a filter that removed nothing, allocates nothing.
    if after.as_slice() == before {
        return Vec::new();
    }
    let mut removed = Vec::new();
    let mut kept = Vec::with_capacity(after.len());
    let mut j = 0;
    for &b in before {
        if after.get(j) == Some(&b) {
            kept.push(b);
            j += 1;
        } else {
            removed.push(b);
        }
    }
    if j != after.len() {
        // The filter broke the contract (added or reordered): trust only
        // what was both before and after.
        kept = before
            .iter()
            .copied()
            .filter(|b| after.contains(b))
            .collect();
        removed = before
            .iter()
            .copied()
            .filter(|b| !after.contains(b))
            .collect();
    }
    *after = kept;
    removed
}

/// Deduplicated in-range picker positions; the best total when the picker
/// returned none (so a broken picker degrades to max-score, never panics).
fn valid_positions(picked: &[usize], totals: &[f64]) -> Vec<usize> {
    let mut seen = vec![false; totals.len()];
    let mut out = Vec::with_capacity(picked.len());
    for &p in picked {
        if let Some(s) = seen.get_mut(p) {
            if !*s {
                *s = true;
                out.push(p);
            }
        }
    }
    if out.is_empty() {
        let best = (0..totals.len()).max_by(|&a, &b| totals[a].total_cmp(&totals[b]));
        out.extend(best);
    }
    out
}

//! A recorder for the `metrics` facade that keeps what the layer and the job runner
//! record, for a test to read: each counter's and gauge's value and each histogram's
//! observations, by name and labels (`name{a=x,b=y}`, the labels sorted). Set it for
//! the test's own thread with `metrics::set_default_local_recorder`.
//!
//! Needs the crate's `metrics` feature: a test declares it next to `common`
//! (`#[path = "common/recorder.rs"] mod recorder;`).
#![allow(unreachable_pub)] // `pub`, as the rest of the tests' support

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

#[derive(Clone, Default)]
pub struct TestRecorder(Arc<Mutex<Recorded>>);

#[derive(Default)]
struct Recorded {
    /// Counters and gauges, by name and labels.
    values: HashMap<String, f64>,
    /// Histograms' observations, by name and labels.
    observed: HashMap<String, Vec<f64>>,
}

impl TestRecorder {
    /// A counter's or gauge's value now (0 if never recorded).
    pub fn value(&self, name: &str) -> f64 {
        self.recorded().values.get(name).copied().unwrap_or(0.0)
    }

    /// How many observations a histogram has had.
    pub fn observations(&self, name: &str) -> usize {
        self.recorded().observed.get(name).map_or(0, Vec::len)
    }

    /// The counters and gauges registered so far, each by name and labels.
    pub fn names(&self) -> Vec<String> {
        self.recorded().values.keys().cloned().collect()
    }

    fn recorded(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.0.lock().expect("the recorder")
    }

    /// The handle of the metric `key`, registered (as zero, or no observations) if new.
    fn handle(&self, key: &Key, histogram: bool) -> Arc<Handle> {
        let mut labels: Vec<_> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let mut recorded = self.recorded();
        if histogram {
            recorded.observed.entry(name.clone()).or_default();
        } else {
            recorded.values.entry(name.clone()).or_default();
        }
        Arc::new(Handle {
            name,
            recorded: self.0.clone(),
        })
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key, false))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.handle(key, false))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.handle(key, true))
    }
}

/// One metric's handle: its updates go to the recorder's maps under its name.
struct Handle {
    name: String,
    recorded: Arc<Mutex<Recorded>>,
}

impl Handle {
    fn update(&self, f: impl FnOnce(&mut f64)) {
        let mut recorded = self.recorded.lock().expect("the recorder");
        f(recorded.values.entry(self.name.clone()).or_default());
    }
}

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        self.update(|v| *v += value as f64);
    }

    fn absolute(&self, value: u64) {
        self.update(|v| *v = v.max(value as f64));
    }
}

impl GaugeFn for Handle {
    fn increment(&self, value: f64) {
        self.update(|v| *v += value);
    }

    fn decrement(&self, value: f64) {
        self.update(|v| *v -= value);
    }

    fn set(&self, value: f64) {
        self.update(|v| *v = value);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        let mut recorded = self.recorded.lock().expect("the recorder");
        recorded
            .observed
            .entry(self.name.clone())
            .or_default()
            .push(value);
    }
}

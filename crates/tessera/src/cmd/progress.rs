//! A progress bar for loading weights, shown only for models big enough to make a user wait.

use indicatif::{ProgressBar, ProgressStyle};
use tessera_model::GgufFile;

/// Models smaller than this load in a blink; no bar.
const SHOW_ABOVE_BYTES: u64 = 64 << 20;

pub struct LoadProgress {
    bar: Option<ProgressBar>,
}

impl LoadProgress {
    pub fn new(gguf: &GgufFile) -> Self {
        let bar = (gguf.file_len() > SHOW_ABOVE_BYTES).then(|| {
            let bar = ProgressBar::new(gguf.file_len());
            bar.set_style(
                ProgressStyle::with_template(
                    "loading {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                )
                .expect("static template"),
            );
            bar
        });
        Self { bar }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
        }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

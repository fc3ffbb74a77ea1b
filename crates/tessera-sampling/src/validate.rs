//! The one place where sampling parameters' ranges are defined and checked.
//!
//! Every front end (OpenAI's chat and completions, Anthropic's Messages, Responses, Ollama,
//! `tessera generate`, `tessera run`) and the coordinator, which must not trust its clients,
//! parse types and then call [`SamplingParams::validate`], so one out-of-range value gets one
//! error, word for word, wherever it is sent. The ranges are what the sampler gives meaning to:
//! OpenAI's where OpenAI documents one (a narrower range an API documents, such as Anthropic's
//! temperature of 0 to 1, is accepted as the wider one; nothing is refused that samples well).

use crate::SamplingParams;

/// A sampling parameter, named as OpenAI's API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingParam {
    Temperature,
    TopP,
    MinP,
    RepetitionPenalty,
    PresencePenalty,
    FrequencyPenalty,
    LogitBias,
}

impl SamplingParam {
    /// The name in requests (OpenAI's spelling; the error names it so).
    pub fn name(self) -> &'static str {
        match self {
            Self::Temperature => "temperature",
            Self::TopP => "top_p",
            Self::MinP => "min_p",
            Self::RepetitionPenalty => "repetition_penalty",
            Self::PresencePenalty => "presence_penalty",
            Self::FrequencyPenalty => "frequency_penalty",
            Self::LogitBias => "logit_bias",
        }
    }

    /// The values it may take, as the error states them.
    pub fn range(self) -> &'static str {
        match self {
            Self::Temperature => "between 0 and 2",
            Self::TopP | Self::MinP => "between 0 and 1",
            Self::RepetitionPenalty => "a positive number",
            Self::PresencePenalty | Self::FrequencyPenalty => "between -2 and 2",
            Self::LogitBias => "between -100 and 100",
        }
    }

    fn admits(self, x: f32) -> bool {
        // `contains` and `>` are false for NaN, so NaN is refused everywhere.
        match self {
            Self::Temperature => (0.0..=2.0).contains(&x),
            Self::TopP | Self::MinP => (0.0..=1.0).contains(&x),
            Self::RepetitionPenalty => x > 0.0 && x.is_finite(),
            Self::PresencePenalty | Self::FrequencyPenalty => (-2.0..=2.0).contains(&x),
            Self::LogitBias => (-100.0..=100.0).contains(&x),
        }
    }
}

/// A parameter outside its range.
#[derive(Clone, Debug, PartialEq)]
pub struct OutOfRange {
    pub param: SamplingParam,
    pub value: f32,
    /// For a logit bias: the token it was given for.
    pub token: Option<u32>,
}

impl std::fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.param.name();
        let what = match self.token {
            Some(t) => format!("{} for token {t}", self.value),
            None => self.value.to_string(),
        };
        write!(f, "Invalid '{name}': {what} is not {}.", self.param.range())
    }
}

impl std::error::Error for OutOfRange {}

impl SamplingParams {
    /// Checks every parameter against its range, in the order of [`SamplingParam`].
    pub fn validate(&self) -> Result<(), OutOfRange> {
        use SamplingParam::*;
        let scalars = [
            (Temperature, self.temperature),
            (TopP, self.top_p),
            (MinP, self.min_p),
            (RepetitionPenalty, self.repeat_penalty),
            (PresencePenalty, self.presence_penalty),
            (FrequencyPenalty, self.frequency_penalty),
        ];
        if let Some(&(param, value)) = scalars.iter().find(|(p, x)| !p.admits(*x)) {
            return Err(OutOfRange {
                param,
                value,
                token: None,
            });
        }
        match self.logit_bias.iter().find(|(_, b)| !LogitBias.admits(*b)) {
            Some(&(token, value)) => Err(OutOfRange {
                param: LogitBias,
                value,
                token: Some(token),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_and_greedy_are_valid() {
        assert_eq!(SamplingParams::default().validate(), Ok(()));
        assert_eq!(SamplingParams::greedy().validate(), Ok(()));
    }

    #[test]
    fn each_parameter_is_refused_outside_its_range_and_named() {
        type Edit = fn(&mut SamplingParams);
        let cases: [(Edit, SamplingParam); 8] = [
            (|p| p.temperature = 2.5, SamplingParam::Temperature),
            (|p| p.temperature = f32::NAN, SamplingParam::Temperature),
            (|p| p.top_p = 1.5, SamplingParam::TopP),
            (|p| p.min_p = -0.1, SamplingParam::MinP),
            (|p| p.repeat_penalty = 0.0, SamplingParam::RepetitionPenalty),
            (|p| p.presence_penalty = 3.0, SamplingParam::PresencePenalty),
            (
                |p| p.frequency_penalty = -2.5,
                SamplingParam::FrequencyPenalty,
            ),
            (
                |p| p.logit_bias = vec![(7, 101.0)],
                SamplingParam::LogitBias,
            ),
        ];
        for (edit, param) in cases {
            let mut p = SamplingParams::default();
            edit(&mut p);
            assert_eq!(p.validate().unwrap_err().param, param);
        }
    }

    #[test]
    fn the_ends_of_each_range_are_valid() {
        let p = SamplingParams {
            temperature: 2.0,
            top_p: 0.0,
            min_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logit_bias: vec![(1, -100.0), (2, 100.0)],
            ..SamplingParams::default()
        };
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn the_error_reads_as_one_sentence_naming_value_and_range() {
        let mut p = SamplingParams {
            temperature: 2.5,
            ..SamplingParams::default()
        };
        assert_eq!(
            p.validate().unwrap_err().to_string(),
            "Invalid 'temperature': 2.5 is not between 0 and 2."
        );
        p.temperature = 1.0;
        p.logit_bias = vec![(42, -250.0)];
        assert_eq!(
            p.validate().unwrap_err().to_string(),
            "Invalid 'logit_bias': -250 for token 42 is not between -100 and 100."
        );
    }
}

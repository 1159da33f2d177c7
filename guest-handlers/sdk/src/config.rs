//! The embedder's `init` settings, read as typed values.

use std::fmt::Display;
use std::ops::RangeInclusive;
use std::str::FromStr;

/// The key/value pairs given to `init`. Each `get*` call takes its key out and remembers
/// it as known; keys left over when [`Policy::init`](crate::Policy::init) returns are
/// rejected with an error that names them and lists the known ones.
///
/// Errors are plain messages (`bad value `x` for `depth`: ...`); the SDK prefixes the
/// policy's name, unless the policy refused with [`refuse_verbatim`](Config::refuse_verbatim).
#[derive(Debug, Clone, Default)]
pub struct Config {
    pairs: Vec<(String, String)>,
    known: Vec<String>,
    verbatim: Option<String>,
    limits: Limits,
}

/// The bounds the host enforces on this policy instance, told at `init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most blocks one `malloc_many` or `free_many` asks for.
    pub batch: u32,
    /// Most bytes of linear memory the policy may grow to; a growth past it fails (the
    /// allocator of the policy's own language reports out of memory).
    pub memory: u64,
    /// Most bytes the policy may hold beyond what its client holds and asks for; an
    /// upstream request or mapping past it is answered 0 / `OverLimit`.
    pub overhead: u64,
}

impl Default for Limits {
    /// The host's defaults.
    fn default() -> Limits {
        Limits {
            batch: 4096,
            memory: 128 << 20,
            overhead: 256 << 20,
        }
    }
}

impl Config {
    /// The configuration `pairs`, in the order the embedder gave them.
    pub fn new(pairs: Vec<(String, String)>) -> Config {
        Config::with_limits(pairs, Limits::default())
    }

    /// The configuration `pairs` under `limits`.
    pub fn with_limits(pairs: Vec<(String, String)>, limits: Limits) -> Config {
        Config {
            pairs,
            known: Vec::new(),
            verbatim: None,
            limits,
        }
    }

    /// The bounds the host enforces on this instance.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The value of `key` as it was given, if it was; a key given twice is an error.
    pub fn get_str(&mut self, key: &str) -> Result<Option<String>, String> {
        if !self.known.iter().any(|k| k == key) {
            self.known.push(key.to_string());
        }
        let mut found = None;
        let mut error = None;
        self.pairs.retain(|(k, v)| {
            if k != key {
                return true;
            }
            if found.is_some() {
                error = Some(format!("`{key}` given more than once"));
            }
            found = Some(v.clone());
            false
        });
        match error {
            Some(e) => Err(e),
            None => Ok(found),
        }
    }

    /// The value of `key` parsed as a `T`, if it was given.
    pub fn get<T>(&mut self, key: &str) -> Result<Option<T>, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        self.get_with(key, |value| {
            value.parse().map_err(|e: T::Err| e.to_string())
        })
    }

    /// The value of `key` read by `parse`, if it was given: for values that are not a
    /// plain `FromStr` (a name from a list) or are checked on the way (a power of two).
    /// `parse` gets the value trimmed and answers why it refuses one; the error then
    /// reads `bad value `VALUE` for `KEY`: WHY`, with the value as given.
    pub fn get_with<T>(
        &mut self,
        key: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        match self.get_str(key)? {
            None => Ok(None),
            Some(value) => parse(value.trim())
                .map(Some)
                .map_err(|why| format!("bad value `{value}` for `{key}`: {why}")),
        }
    }

    /// The value of `key` parsed as a `T`, or `default` when it was not given.
    pub fn get_or<T>(&mut self, key: &str, default: T) -> Result<T, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        Ok(self.get(key)?.unwrap_or(default))
    }

    /// As [`get_or`](Config::get_or), and the value (given or default) must lie in `range`.
    pub fn get_in<T>(
        &mut self,
        key: &str,
        range: RangeInclusive<T>,
        default: T,
    ) -> Result<T, String>
    where
        T: FromStr + PartialOrd + Display,
        T::Err: Display,
    {
        let value = self.get_or(key, default)?;
        if range.contains(&value) {
            Ok(value)
        } else {
            Err(format!(
                "bad value `{value}` for `{key}`: want {}..={}",
                range.start(),
                range.end()
            ))
        }
    }

    /// Every pair not taken yet, for a policy that accepts keys it cannot list in advance.
    pub fn take_rest(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.pairs)
    }

    /// Refuse the configuration with exactly `message`, without the policy's name in
    /// front; return what this returns as `init`'s `Err`. For a refusal a program reads
    /// (a test fixture's report of what its sandbox showed it), not a person. It wins
    /// over everything else: `init` fails with `message` whatever it returns, and keys
    /// left unread are not looked at.
    pub fn refuse_verbatim(&mut self, message: impl Into<String>) -> String {
        let message = message.into();
        self.verbatim = Some(message.clone());
        message
    }

    /// The message given to [`refuse_verbatim`](Config::refuse_verbatim), if it was.
    pub(crate) fn take_verbatim(&mut self) -> Option<String> {
        self.verbatim.take()
    }

    /// `Err` naming the first key nobody took, and the keys that are known.
    pub(crate) fn finish(self) -> Result<(), String> {
        let Some((key, value)) = self.pairs.first() else {
            return Ok(());
        };
        let known = if self.known.is_empty() {
            "this policy takes no configuration".to_string()
        } else {
            format!("known: {}", self.known.join(", "))
        };
        Err(format!(
            "unknown config key `{key}` (value `{value}`); {known}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> Config {
        Config::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn typed_values_defaults_and_ranges() {
        let mut c = config(&[("depth", " 7 "), ("batch", "false")]);
        assert_eq!(c.get_in("depth", 0..=64, 3), Ok(7u32));
        assert_eq!(c.get::<bool>("batch"), Ok(Some(false)));
        assert_eq!(c.get_or("missing", 5u8), Ok(5));
        assert_eq!(c.finish(), Ok(()));
    }

    #[test]
    fn errors_say_which_key_and_why() {
        let mut c = config(&[("depth", "x")]);
        let e = c.get::<u32>("depth").unwrap_err();
        assert!(e.starts_with("bad value `x` for `depth`"), "{e}");

        let mut c = config(&[("depth", "99")]);
        let e = c.get_in("depth", 0..=64u32, 3).unwrap_err();
        assert_eq!(e, "bad value `99` for `depth`: want 0..=64");

        let mut c = config(&[("depth", "1"), ("depth", "2")]);
        assert_eq!(
            c.get::<u32>("depth"),
            Err("`depth` given more than once".into())
        );
    }

    #[test]
    fn a_parser_of_its_own_says_why_it_refuses() {
        fn power_of_two(value: &str) -> Result<u64, String> {
            match value.parse::<u64>() {
                Ok(n) if n.is_power_of_two() => Ok(n),
                _ => Err("want a power of two".into()),
            }
        }
        let mut c = config(&[("alignment", " 64 "), ("chunk", "48")]);
        assert_eq!(c.get_with("alignment", power_of_two), Ok(Some(64)));
        assert_eq!(
            c.get_with("chunk", power_of_two),
            Err("bad value `48` for `chunk`: want a power of two".into())
        );
        assert_eq!(c.get_with("missing", power_of_two), Ok(None));
        assert_eq!(c.finish(), Ok(()));
    }

    #[test]
    fn a_verbatim_refusal_is_kept_for_the_sdk() {
        let mut c = config(&[("probe", "yes")]);
        assert_eq!(c.take_verbatim(), None);
        assert_eq!(c.refuse_verbatim("probe: env=[]"), "probe: env=[]");
        assert_eq!(c.take_verbatim(), Some("probe: env=[]".into()));
    }

    #[test]
    fn unread_keys_are_rejected_with_the_known_ones() {
        let c = config(&[("colour", "red")]);
        assert_eq!(
            c.finish(),
            Err(
                "unknown config key `colour` (value `red`); this policy takes no configuration"
                    .into()
            )
        );
        let mut c = config(&[("colour", "red")]);
        c.get::<u32>("depth").unwrap();
        c.get::<u32>("large-cache").unwrap();
        assert_eq!(
            c.finish(),
            Err("unknown config key `colour` (value `red`); known: depth, large-cache".into())
        );
    }
}

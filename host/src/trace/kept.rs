//! What a reader keeps of a trace's marks and sites, in either form, within bounds of
//! their own. A trace of a few kilobytes can say millions of marks or sites (they
//! compress to almost nothing), and each one kept costs memory and, on a page, its size.
//! So past [`MAX_MARKS`] marks (or [`MAX_MARK_TEXT_BYTES`] of their text) the rest are
//! counted and summed by one mark where the first of them was; past [`MAX_SITES`] sites
//! (or [`MAX_SITE_NAME_BYTES`] of their names) the rest are counted and their events
//! have no line. A name is cut to the recorder's bound, escaped and shared with every
//! other site of the same name. A site defined again under its number replaces itself.

use std::collections::HashSet;
use std::sync::Arc;

use super::{Mark, Site, Trace};

/// The most marks a trace keeps: a test suite's tests, far past NumPy's whole suite.
pub const MAX_MARKS: usize = 100_000;
/// The most bytes of marks' text a trace keeps.
pub const MAX_MARK_TEXT_BYTES: usize = 16 << 20;
/// The most sites a trace keeps: lines of a program that allocate.
pub const MAX_SITES: usize = 1 << 18;
/// The most bytes of distinct names (files and functions) a trace's sites keep.
pub const MAX_SITE_NAME_BYTES: usize = 64 << 20;
/// The most of a file's or function's name kept in a site: what the recorder writes.
pub const MAX_NAME_BYTES: usize = 16 << 10;

/// A reader's account of what it kept and what it only counted.
#[derive(Debug, Default)]
pub(crate) struct Keeper {
    mark_bytes: usize,
    marks_left_out: u64,
    names: HashSet<Arc<str>>,
    name_bytes: usize,
    sites_left_out: u64,
}

impl Keeper {
    /// Whether another mark of `text` is kept beside the `kept` ones; one that is not
    /// is counted.
    pub(crate) fn keep_mark(&mut self, kept: usize, text: &str) -> bool {
        if self.marks_left_out == 0
            && kept < MAX_MARKS
            && self.mark_bytes + text.len() <= MAX_MARK_TEXT_BYTES
        {
            self.mark_bytes += text.len();
            return true;
        }
        self.marks_left_out += 1;
        false
    }

    /// Whether a mark was left out yet: the first one left out is where the sum goes.
    pub(crate) fn marks_left_out(&self) -> u64 {
        self.marks_left_out
    }

    /// Whether sites were left out: an event may then name one that is not kept.
    pub(crate) fn sites_left_out(&self) -> u64 {
        self.sites_left_out
    }

    /// A name read from a trace: cut to [`MAX_NAME_BYTES`], escaped (a trace is input),
    /// and the one copy of it; `None` once the names kept reach their bound.
    pub(crate) fn name(&mut self, raw: &str) -> Option<Arc<str>> {
        let cut = &raw[..raw.floor_char_boundary(MAX_NAME_BYTES)];
        let name = crate::untrusted::escape(cut);
        if let Some(kept) = self.names.get(name.as_str()) {
            return Some(kept.clone());
        }
        if self.name_bytes + name.len() > MAX_SITE_NAME_BYTES {
            return None;
        }
        self.name_bytes += name.len();
        let name: Arc<str> = name.into();
        self.names.insert(name.clone());
        Some(name)
    }

    /// A site of `line` in `function` of `file` (raw names), if the sites kept have room
    /// for one more beside the `kept` ones (`replaces`: it takes the place of one kept);
    /// counted as left out if not.
    pub(crate) fn site(
        &mut self,
        kept: usize,
        replaces: bool,
        line: u32,
        function: &str,
        file: &str,
    ) -> Option<Site> {
        let site = (replaces || kept < MAX_SITES)
            .then(|| {
                Some(Site {
                    function: self.name(function)?,
                    file: self.name(file)?,
                    line,
                    via: None,
                })
            })
            .flatten();
        if site.is_none() {
            self.sites_left_out += 1;
        }
        site
    }

    /// Close the account into `trace`: the counts, and the mark that sums the marks
    /// left out (at `first_left_out`, the events before the first of them).
    pub(crate) fn finish(self, trace: &mut Trace, first_left_out: Option<u64>) {
        trace.marks_left_out = self.marks_left_out;
        trace.sites_left_out = self.sites_left_out;
        if let Some(at) = first_left_out.filter(|_| self.marks_left_out > 0) {
            trace.marks.push(left_out_mark(at, self.marks_left_out));
        }
    }
}

/// The mark that stands for the `left_out` marks from event `at` on.
pub(crate) fn left_out_mark(at: u64, left_out: u64) -> Mark {
    Mark {
        at,
        text: format!(
            "{left_out} more marks from here on, not kept (a trace keeps {MAX_MARKS} marks \
             and {} MiB of their text)",
            MAX_MARK_TEXT_BYTES >> 20
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_past_the_bound_are_counted_not_kept() {
        let mut keeper = Keeper::default();
        assert!((0..MAX_MARKS).all(|kept| keeper.keep_mark(kept, "")));
        assert!(!keeper.keep_mark(MAX_MARKS, ""));
        assert!(!keeper.keep_mark(MAX_MARKS, ""));
        assert_eq!(keeper.marks_left_out(), 2);
    }

    #[test]
    fn marks_past_their_text_bound_are_counted_and_none_is_kept_after_the_first_left_out() {
        let mut keeper = Keeper::default();
        let long = "x".repeat(1024);
        let fit = MAX_MARK_TEXT_BYTES / long.len();
        assert!((0..fit).all(|kept| keeper.keep_mark(kept, &long)));
        assert!(!keeper.keep_mark(fit, &long));
        assert!(!keeper.keep_mark(fit, ""), "kept marks are the first ones");
    }

    #[test]
    fn names_are_cut_escaped_and_shared() {
        let mut keeper = Keeper::default();
        let long = "é".repeat(MAX_NAME_BYTES);
        assert_eq!(keeper.name(&long).unwrap().len(), MAX_NAME_BYTES);
        let a = keeper.name("a\u{1b}b").unwrap();
        assert_eq!(&*a, "a\\u{1b}b");
        assert!(Arc::ptr_eq(&a, &keeper.name("a\u{1b}b").unwrap()));
    }

    #[test]
    fn sites_past_the_bound_or_past_their_names_bound_are_counted_not_kept() {
        let mut keeper = Keeper::default();
        assert!(keeper.site(MAX_SITES - 1, false, 1, "f", "a.py").is_some());
        assert!(keeper.site(MAX_SITES, false, 1, "f", "a.py").is_none());
        assert!(keeper.site(MAX_SITES, true, 1, "f", "a.py").is_some());
        let mut names = 0;
        while keeper
            .site(0, false, 1, &format!("{names:0>16384}"), "a.py")
            .is_some()
        {
            names += 1;
        }
        assert_eq!(names, MAX_SITE_NAME_BYTES / MAX_NAME_BYTES - 1);
        assert_eq!(keeper.sites_left_out(), 2);
    }
}

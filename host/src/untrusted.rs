//! Text a policy supplies (its name, its `init` error, what it printed, names in its
//! binary that a compiler error echoes), made safe to print: control characters and
//! bidirectional overrides become visible escapes, so a policy cannot move a terminal's
//! cursor, set its title, clear it, or reorder the text around its own.
//!
//! Every such string is escaped once, where it enters the host's errors and records,
//! so every later printer (the command line, logs, Python exceptions, report pages)
//! shows it safely without knowing where it came from.

/// `text` with every control character (C0, DEL, C1) and every bidirectional
/// embedding, override or isolate replaced by its Rust escape (`\u{1b}`, `\n`).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() || is_bidi_control(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

/// [`escape`] of the first `bytes` bytes of `text` at most (cut at a character
/// boundary, with `…` where it was cut): for text a policy may make as long as its
/// memory, shown where a line is expected.
pub fn escape_at_most(text: &str, bytes: usize) -> String {
    if text.len() <= bytes {
        return escape(text);
    }
    let cut = text.floor_char_boundary(bytes);
    format!("{}…", escape(&text[..cut]))
}

/// Characters that reorder the text around them: embeddings and overrides
/// (U+202A..=U+202E), isolates (U+2066..=U+2069) and the marks (U+200E, U+200F, U+061C).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn long_text_is_cut_at_a_character_boundary_before_it_is_escaped() {
        use super::escape_at_most;
        assert_eq!(escape_at_most("short", 64), "short");
        assert_eq!(escape_at_most(&"n".repeat(4096), 8), "nnnnnnnn…");
        // `é` is two bytes: a cut inside it falls before it.
        assert_eq!(escape_at_most("abé", 3), "ab…");
        assert_eq!(escape_at_most("\u{1b}\u{1b}x", 2), "\\u{1b}\\u{1b}…");
    }

    #[test]
    fn terminal_escape_sequences_become_visible_text() {
        assert_eq!(
            escape("a\u{1b}]0;owned\u{7}\u{1b}[2Jb"),
            "a\\u{1b}]0;owned\\u{7}\\u{1b}[2Jb"
        );
        assert_eq!(escape("line\nnext\ttab\r"), "line\\nnext\\ttab\\r");
        assert_eq!(escape("\u{9b}31m"), "\\u{9b}31m");
    }

    #[test]
    fn bidirectional_overrides_become_visible_text() {
        assert_eq!(escape("ab\u{202e}cd\u{2066}"), "ab\\u{202e}cd\\u{2066}");
    }

    #[test]
    fn ordinary_text_is_unchanged() {
        let text = "size-classes: bukket-depth is not a key; Größe 16 → 32 ✓";
        assert_eq!(escape(text), text);
    }
}

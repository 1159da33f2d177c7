//! Policies in every language: each is a component or core module the host loads as it
//! is, and says what it was written in.

use super::support::*;

#[test]
fn every_good_policy_says_the_language_it_was_written_in() {
    for guest in allocbox_artifacts::GOOD {
        let said = load(guest).language().map(str::to_string);
        let expected = (guest.language != "WAT").then(|| guest.language.to_string());
        assert_eq!(said, expected, "{}", guest.name);
    }
}

#[test]
fn the_guests_cover_the_languages_the_project_promises() {
    let mut languages: Vec<&str> = allocbox_artifacts::GOOD
        .iter()
        .map(|g| g.language)
        .collect();
    languages.sort_unstable();
    languages.dedup();
    for promised in [
        "AssemblyScript",
        "C",
        "Go",
        "JavaScript",
        "Python",
        "Rust",
        "WAT",
        "Zig",
    ] {
        assert!(
            languages.contains(&promised),
            "no good policy in {promised}"
        );
    }
}

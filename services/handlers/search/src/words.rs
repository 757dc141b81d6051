//! How text becomes the words the index holds and a query asks for.
//!
//! Text written with spaces between words (Latin, Cyrillic, Greek, Arabic, ...) is split as
//! tantivy's default analyzer splits it: a word is a run of letters and digits, lowercased, and a
//! word of 40 bytes or more is left out. Its letters are then folded to the ASCII letters they
//! are written with where they have one (`é` as `e`, `ß` as `ss`), so "amelie" finds "Amélie";
//! a query also asks for the word as typed, which documents indexed before folding hold. Text is
//! taken composed (NFC): `e` followed by a combining acute accent is the one letter `é`, not a
//! word split at the accent. Chinese, Japanese, Thai, Lao, Burmese and Khmer are
//! written without spaces between words (Korean with particles joined to the word), so there a
//! run is one "word" of a whole sentence, which nobody searches for and which is mostly over 40
//! bytes. Those scripts are split into characters instead (a character with the marks that
//! follow it): the index holds every character of such a run and every pair
//! of neighbouring characters; a query asks for each pair of neighbours in its run (all must be
//! there), or for the character when its run is one character long. So "千尋" finds
//! "千と千尋の神隠し", and "侍" finds "七人の侍", as the CJK analyzers of the common search
//! engines do. Those characters are taken in one form (NFKC: half-width katakana as full-width,
//! a decomposed voicing mark composed, variation selectors dropped), in the index and in queries.
//!
//! The analyzer is registered under tantivy's name `default`, the name the schema's text fields
//! were created with, so an index written before still opens. Documents indexed before are
//! found as they were: a query also accepts a word as typed (before folding), and for text with
//! a joined script in it the words the first analyzer made of it (a whole run under 40 bytes);
//! the rest is found once the document is indexed again (its next change). Decomposed text
//! indexed before folding was split at its marks, and is found by its words once indexed again.

use std::borrow::Cow;

use tantivy::tokenizer::{
    AsciiFoldingFilter, BoxTokenStream, LowerCaser, RawTokenizer, RemoveLongFilter, SimpleTokenizer, TextAnalyzer,
    Token, TokenStream, Tokenizer,
};
use unicode_normalization::char::is_combining_mark;
use unicode_normalization::{IsNormalized, UnicodeNormalization, is_nfc_quick, is_nfkc_quick};

/// The name the schema's text fields refer to their analyzer by.
pub const ANALYZER: &str = "default";

/// Words of 40 bytes or more are left out, as tantivy's default analyzer does.
const LONGEST: usize = 40;

/// Whether `c` is written without spaces between words: a Han character, Hiragana, Katakana
/// (half-width too), Hangul, or Thai, Lao, Burmese or Khmer.
fn joined_script(c: char) -> bool {
    matches!(c,
        '\u{0E00}'..='\u{0EFF}'     // Thai, Lao
        | '\u{1000}'..='\u{109F}'   // Myanmar
        | '\u{1100}'..='\u{11FF}'   // Hangul Jamo
        | '\u{1780}'..='\u{17FF}'   // Khmer
        | '\u{3005}' | '\u{3007}'   // 々 〇
        | '\u{3040}'..='\u{30FF}'   // Hiragana, Katakana
        | '\u{3130}'..='\u{318F}'   // Hangul Compatibility Jamo
        | '\u{31F0}'..='\u{31FF}'   // Katakana Phonetic Extensions
        | '\u{3400}'..='\u{4DBF}'   // CJK Extension A
        | '\u{4E00}'..='\u{9FFF}'   // CJK Unified Ideographs
        | '\u{A960}'..='\u{A97F}'   // Hangul Jamo Extended-A
        | '\u{AC00}'..='\u{D7FF}'   // Hangul Syllables, Jamo Extended-B
        | '\u{F900}'..='\u{FAFF}'   // CJK Compatibility Ideographs
        | '\u{FF66}'..='\u{FF9F}'   // Half-width Katakana
        | '\u{20000}'..='\u{3134F}' // CJK Extensions B to G, Compatibility Supplement
    )
}

/// A run of letters and digits of one kind, as byte offsets into the text. A run of a joined
/// script also takes the marks that follow its characters (a decomposed kana's voicing mark, a
/// variation selector).
struct Run {
    from: usize,
    to: usize,
    joined: bool,
}

/// The runs of `text`: letters and digits, split where the kind changes and at anything else.
fn runs(text: &str) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut open: Option<Run> = None;
    for (at, c) in text.char_indices() {
        let to = at + c.len_utf8();
        let kind = if c.is_alphanumeric() {
            Some(joined_script(c))
        } else if is_combining_mark(c) && open.as_ref().is_some_and(|run| run.joined) {
            Some(true)
        } else {
            None
        };
        match (&mut open, kind) {
            (Some(run), Some(joined)) if run.joined == joined => run.to = to,
            (_, kind) => {
                runs.extend(open.take());
                open = kind.map(|joined| Run { from: at, to, joined });
            }
        }
    }
    runs.extend(open);
    runs
}

/// The word of a run of a space-separated script, if it is short enough to keep, lowercased
/// (not folded: see [`fold`]).
fn spaced_word(text: &str) -> Option<String> {
    (text.len() < LONGEST).then(|| text.chars().flat_map(char::to_lowercase).collect())
}

/// `word` with its letters folded to ASCII where they have an ASCII form (`é` as `e`, `æ` as
/// `ae`), as the index holds a word of a space-separated script.
fn fold(word: String) -> String {
    if word.is_ascii() {
        return word;
    }
    thread_local! {
        // Built once per thread, not once per word.
        static FOLDER: std::cell::RefCell<TextAnalyzer> =
            std::cell::RefCell::new(TextAnalyzer::builder(RawTokenizer::default()).filter(AsciiFoldingFilter).build());
    }
    let folded = FOLDER.with_borrow_mut(|folder| {
        let mut stream = folder.token_stream(&word);
        stream.advance().then(|| stream.token().text.clone())
    });
    folded.unwrap_or(word)
}

/// `text` composed (NFC), borrowed when it is already.
fn composed(text: &str) -> Cow<'_, str> {
    if is_nfc_quick(text.chars()) == IsNormalized::Yes {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.nfc().collect())
}

/// Whether `c` only selects a glyph of the character before it.
fn variation_selector(c: char) -> bool {
    matches!(c, '\u{FE00}'..='\u{FE0F}' | '\u{E0100}'..='\u{E01EF}')
}

/// A run of a joined script in one form: compatibility forms folded (half-width katakana,
/// compatibility ideographs), voicing marks composed, variation selectors dropped. Most text is
/// in that form already and is returned as it is.
fn one_form(text: &str) -> Cow<'_, str> {
    if is_nfkc_quick(text.chars()) == IsNormalized::Yes && !text.chars().any(variation_selector) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.nfkc().filter(|&c| !variation_selector(c)).collect())
}

/// The characters of a run of a joined script, in [`one_form`], each with the one after it
/// (if any): what the index holds of it. A character keeps the marks that follow it (a Thai
/// vowel or tone mark, a voicing mark that did not compose).
fn characters(text: &str) -> Vec<(&str, Option<&str>)> {
    let mut at: Vec<usize> =
        text.char_indices().filter(|&(i, c)| i == 0 || !is_combining_mark(c)).map(|(i, _)| i).collect();
    at.push(text.len());
    (0..at.len() - 1).map(|i| (&text[at[i]..at[i + 1]], at.get(i + 2).map(|&to| &text[at[i]..to]))).collect()
}

/// The words `text` is indexed under, in order. A character of a joined script, and a pair, has
/// its run's offsets (its form may differ from the text's).
fn index_tokens(text: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut push = |run: &Run, word: String| {
        let position = tokens.len();
        tokens.push(Token { offset_from: run.from, offset_to: run.to, position, text: word, position_length: 1 });
    };
    for run in runs(text) {
        let part = &text[run.from..run.to];
        if !run.joined {
            if let Some(word) = spaced_word(part) {
                push(&run, fold(word));
            }
            continue;
        }
        let part = one_form(part);
        for (c, pair) in characters(&part) {
            push(&run, c.to_owned());
            if let Some(pair) = pair {
                push(&run, pair.to_owned());
            }
        }
    }
    tokens
}

/// One thing a hit must hold: every word of one of `alternatives`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub alternatives: Vec<Vec<String>>,
}

/// What a query for `text` asks for: each [`Wanted`] must be in a hit. A word of a
/// space-separated script is wanted folded, or as typed (lowercased), as documents indexed
/// before folding hold it. A stretch of text with a joined script in it
/// (letters, digits and marks with no space) is wanted by its own words: those of its spaced
/// runs, each pair of neighbouring characters of its joined runs (the character, for a run of
/// one); or, as the alternative, by the words the analyzer before this one made of it (a whole
/// run of letters and digits, lowercased, under 40 bytes), which documents indexed before hold.
pub fn query(text: &str) -> Vec<Wanted> {
    let text = &*composed(text);
    let mut wanted: Vec<Wanted> = Vec::new();
    let mut want = |alternatives: Vec<Vec<String>>| {
        let w = Wanted { alternatives };
        if !w.alternatives.is_empty() && !wanted.contains(&w) {
            wanted.push(w);
        }
    };
    // A stretch: runs that touch.
    // (A word of a space-separated script alone is a stretch of one run: its alternatives are
    // its folded and typed forms, the analyzer before's being the typed one.)
    for stretch in runs(text).chunk_by(|a, b| a.to == b.from) {
        // Its words as indexed now (spaced words folded), as the build before folding indexed
        // them (spaced words as typed), and as the analyzer before that (one word per run).
        let (mut own, mut typed): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
        for run in stretch {
            let part = &text[run.from..run.to];
            if run.joined {
                let part = one_form(part);
                let words: Vec<String> = match &characters(&part)[..] {
                    [] => Vec::new(),
                    [(c, None)] => vec![c.to_string()],
                    chars => chars.iter().filter_map(|(_, pair)| pair.map(str::to_owned)).collect(),
                };
                own.extend(words.iter().cloned());
                typed.extend(words);
            } else if let Some(word) = spaced_word(part) {
                own.push(fold(word.clone()));
                typed.push(word);
            }
        }
        own.dedup();
        typed.dedup();
        let text = &text[stretch[0].from..stretch[stretch.len() - 1].to];
        let before: Vec<String> =
            text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).filter_map(spaced_word).collect();
        let mut alternatives: Vec<Vec<String>> = Vec::new();
        for words in [own, typed, before] {
            if !words.is_empty() && !alternatives.contains(&words) {
                alternatives.push(words);
            }
        }
        want(alternatives);
    }
    wanted
}

/// The index's analyzer (see the module's documentation). Composed text with no character of a
/// joined script (most of it) goes through tantivy's own filters, at their speed (building each
/// token as below took six times as long for an English review).
#[derive(Clone)]
pub struct Words {
    spaced: TextAnalyzer,
}

impl Default for Words {
    fn default() -> Self {
        // tantivy's default analyzer, then the folding.
        let spaced = TextAnalyzer::builder(SimpleTokenizer::default())
            .filter(RemoveLongFilter::limit(LONGEST))
            .filter(LowerCaser)
            .filter(AsciiFoldingFilter)
            .build();
        Self { spaced }
    }
}

/// The words of one text.
pub enum WordStream<'a> {
    Spaced(BoxTokenStream<'a>),
    Made { tokens: Vec<Token>, next: usize },
}

impl Tokenizer for Words {
    type TokenStream<'a> = WordStream<'a>;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> WordStream<'a> {
        // This runs in tantivy's indexing thread, where a panic would fail the whole commit (every
        // event that shared it): a text this code chokes on is indexed without words instead.
        let made = std::panic::catch_unwind(|| {
            #[cfg(test)]
            if text == tests::CHOKES {
                panic!("a text the word splitter chokes on");
            }
            match composed(text) {
                // Rare: its words are made here, their offsets into the composed text.
                Cow::Owned(composed) => Some(index_tokens(&composed)),
                Cow::Borrowed(_) if text.is_ascii() || !text.chars().any(joined_script) => None,
                Cow::Borrowed(_) => Some(index_tokens(text)),
            }
        });
        match made {
            Ok(None) => WordStream::Spaced(self.spaced.token_stream(text)),
            Ok(Some(tokens)) => WordStream::Made { tokens, next: 0 },
            Err(_) => {
                tracing::error!(
                    chars = text.chars().count(),
                    "a text could not be split into words; indexed without them"
                );
                WordStream::Made { tokens: Vec::new(), next: 0 }
            }
        }
    }
}

impl TokenStream for WordStream<'_> {
    fn advance(&mut self) -> bool {
        match self {
            WordStream::Spaced(stream) => stream.advance(),
            WordStream::Made { tokens, next } => {
                *next += 1;
                *next <= tokens.len()
            }
        }
    }

    fn token(&self) -> &Token {
        match self {
            WordStream::Spaced(stream) => stream.token(),
            WordStream::Made { tokens, next } => &tokens[*next - 1],
        }
    }

    fn token_mut(&mut self) -> &mut Token {
        match self {
            WordStream::Spaced(stream) => stream.token_mut(),
            WordStream::Made { tokens, next } => &mut tokens[*next - 1],
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A text [`Words`] panics on, in tests: a fault of the word splitter on one text.
    pub(crate) const CHOKES: &str = "a text the word splitter chokes on";

    fn indexed(text: &str) -> Vec<String> {
        let mut analyzer = TextAnalyzer::from(Words::default());
        let mut stream = analyzer.token_stream(text);
        let mut words = Vec::new();
        while stream.advance() {
            words.push(stream.token().text.clone());
        }
        words
    }

    /// The words tantivy's default analyzer (the one before) makes of `text`, with offsets.
    fn before(text: &str) -> Vec<(String, usize, usize)> {
        let mut theirs = tantivy::tokenizer::TokenizerManager::default().get("default").unwrap();
        let mut stream = theirs.token_stream(text);
        let mut words = Vec::new();
        while stream.advance() {
            let t = stream.token();
            words.push((t.text.clone(), t.offset_from, t.offset_to));
        }
        words
    }

    fn words(list: &[&str]) -> Vec<String> {
        list.iter().map(|w| w.to_string()).collect()
    }

    /// What `text`'s query asks for, each wanted as its alternatives.
    fn asked(text: &str) -> Vec<Vec<Vec<String>>> {
        query(text).into_iter().map(|w| w.alternatives).collect()
    }

    /// Text of the space-separated scripts gets the words tantivy's default analyzer gave it, at
    /// the same offsets, folded; a query wants each of those words folded, or as the analyzer
    /// before made it (what documents indexed before hold).
    #[test]
    fn spaced_scripts_are_split_as_tantivys_default_analyzer_splits_them() {
        let samples = [
            "Heat (1995) — the diner scene; De Niro & Pacino!",
            "Amélie's ÉTÉ: Ça va, Straße, İstanbul, ΣΊΣΥΦΟΣ",
            "Сталкер, Солярис — Тарковский 1979",
            "word_with_underscores dash-joined 3.14 ٣٤ الفيلم heat",
            "a-very-long-but-split word and onewordthatislongerthanfortybytesforsure!",
            "",
            "   \t\n",
        ];
        for sample in samples {
            let expected: Vec<_> = before(sample).into_iter().map(|(word, from, to)| (fold(word), from, to)).collect();
            let ours: Vec<_> = index_tokens(sample).into_iter().map(|t| (t.text, t.offset_from, t.offset_to)).collect();
            assert_eq!(ours, expected, "{sample:?}");
            assert_eq!(indexed(sample), expected.iter().map(|(word, ..)| word.clone()).collect::<Vec<_>>());
            let mut each: Vec<Vec<Vec<String>>> = Vec::new();
            for (word, _, _) in before(sample) {
                let folded = fold(word.clone());
                let wanted = if folded == word { vec![vec![word]] } else { vec![vec![folded], vec![word]] };
                if !each.contains(&wanted) {
                    each.push(wanted);
                }
            }
            assert_eq!(asked(sample), each, "{sample:?}");
        }
    }

    /// Letters with marks are held as their ASCII letters, however they were typed: composed,
    /// decomposed (`e` and a combining accent), upper or lower case.
    #[test]
    fn accents_are_folded_and_decomposed_text_is_composed() {
        assert_eq!(indexed("Amélie"), ["amelie"]);
        assert_eq!(indexed("AME\u{0301}LIE"), ["amelie"], "one word, not two split at the accent");
        assert_eq!(indexed("Straße Ærø"), ["strasse", "aero"]);
        assert_eq!(asked("ame\u{0301}lie"), [vec![words(&["amelie"]), words(&["amélie"])]]);
        assert_eq!(asked("Amelie"), [vec![words(&["amelie"])]]);
        // The joined scripts' neighbours are folded too, and decomposed text composed.
        assert_eq!(indexed("Cafe\u{0301}見た"), ["cafe", "見", "見た", "た"]);
        // A stretch of accented letters and a joined script: its words folded, as typed (what
        // the build before folding indexed), or its runs whole (the analyzer before that).
        assert_eq!(
            asked("Amélieを見た"),
            [vec![words(&["amelie", "を見", "見た"]), words(&["amélie", "を見", "見た"]), words(&["amélieを見た"])]]
        );
    }

    #[test]
    fn joined_scripts_are_indexed_by_characters_and_pairs() {
        assert_eq!(indexed("七人の侍"), ["七", "七人", "人", "人の", "の", "の侍", "侍"]);
        assert_eq!(indexed("侍"), ["侍"]);
        // Another script, a space or punctuation ends the run.
        assert_eq!(indexed("Heat見た、良い"), ["heat", "見", "見た", "た", "良", "良い", "い"]);
        assert_eq!(indexed("영화 좋아"), ["영", "영화", "화", "좋", "좋아", "아"]);
        // A sentence over 40 bytes is not left out.
        let sentence = "千と千尋の神隠しは何度見ても新しい発見がある";
        assert!(sentence.len() > LONGEST);
        assert!(indexed(sentence).contains(&"発見".to_owned()));
        // One form: decomposed voicing marks, half-width katakana, variation selectors.
        let composed = indexed("ガイド");
        assert_eq!(indexed("\u{30AB}\u{3099}\u{30A4}\u{30C8}\u{3099}"), composed);
        assert_eq!(indexed("ｶﾞｲﾄﾞ"), composed);
        assert_eq!(indexed("葛\u{E0100}飾"), indexed("葛飾"));
        // A character keeps its marks (Thai vowels and tones).
        assert_eq!(indexed("ข้าว"), ["ข้", "ข้า", "า", "าว", "ว"]);
        assert_eq!(indexed("\u{3042}\u{3099}"), ["\u{3042}\u{3099}"], "a voicing mark that does not compose");
    }

    #[test]
    fn a_query_asks_for_each_pair_or_what_the_analyzer_before_made() {
        assert_eq!(asked("千と千尋"), [vec![words(&["千と", "と千", "千尋"]), words(&["千と千尋"])]]);
        assert_eq!(asked("侍"), [vec![words(&["侍"])]]);
        // The analyzer before split Thai at every mark.
        assert_eq!(asked("ข้าว"), [vec![words(&["ข้า", "าว"]), words(&["ข", "าว"])]]);
        assert_eq!(
            asked("Heat 侍 神隠し heat"),
            [vec![words(&["heat"])], vec![words(&["侍"])], vec![words(&["神隠", "隠し"]), words(&["神隠し"])]]
        );
        // A stretch of two scripts: its own words, or the one word it was.
        assert_eq!(asked("BTS의"), [vec![words(&["bts", "의"]), words(&["bts의"])]]);
        // The before words of a long run are left out, as they were.
        let sentence = "千と千尋の神隠しは何度見ても新しい発見がある";
        assert_eq!(query(sentence)[0].alternatives.len(), 1);
        // Every pair a query asks for of a text is indexed for that text.
        let text = "ハウルの動く城を映画館で観た";
        let held = indexed(text);
        for part in [text, "動く城", "ハウル"] {
            assert!(query(part).iter().all(|w| w.alternatives[0].iter().all(|p| held.contains(p))), "{part}");
        }
    }
}

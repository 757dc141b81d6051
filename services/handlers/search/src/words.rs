//! How text becomes the words the index holds and a query asks for.
//!
//! Text written with spaces between words (Latin, Cyrillic, Greek, Arabic, ...) is split as
//! tantivy's default analyzer splits it: a word is a run of letters and digits, lowercased, and a
//! word of 40 bytes or more is left out. Chinese, Japanese and Korean are written without spaces
//! (or, in Korean, with particles joined to the word), so there a run is one "word" of a whole
//! sentence, which nobody searches for and which is mostly over 40 bytes. Those scripts are
//! split into characters instead: the index holds every character of such a run and every pair
//! of neighbouring characters; a query asks for each pair of neighbours in its run (all must be
//! there), or for the character when its run is one character long. So "千尋" finds
//! "千と千尋の神隠し", and "侍" finds "七人の侍", as the CJK analyzers of the common search
//! engines do.
//!
//! The analyzer is registered under tantivy's name `default`, the name the schema's text fields
//! were created with, so an index written before still opens; its documents' words are the same
//! for the space-separated scripts, and a document with Chinese, Japanese or Korean text is
//! found by them once it is indexed again (its next change).

use tantivy::tokenizer::{Token, TokenStream, Tokenizer};

/// The name the schema's text fields refer to their analyzer by.
pub const ANALYZER: &str = "default";

/// Words of 40 bytes or more are left out, as tantivy's default analyzer does.
const LONGEST: usize = 40;

/// Whether `c` is written without spaces between words: a Han character, Hiragana, Katakana
/// (half-width too) or Hangul.
fn joined_script(c: char) -> bool {
    matches!(c,
        '\u{1100}'..='\u{11FF}'     // Hangul Jamo
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

/// A run of letters and digits of one kind, as byte offsets into the text.
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
        let kind = c.is_alphanumeric().then(|| joined_script(c));
        match (&mut open, kind) {
            (Some(run), Some(joined)) if run.joined == joined => run.to = at + c.len_utf8(),
            (_, kind) => {
                runs.extend(open.take());
                open = kind.map(|joined| Run { from: at, to: at + c.len_utf8(), joined });
            }
        }
    }
    runs.extend(open);
    runs
}

/// The word of a run of a space-separated script, if it is short enough to keep.
fn spaced_word(text: &str, run: &Run) -> Option<String> {
    let word = &text[run.from..run.to];
    (word.len() < LONGEST).then(|| word.chars().flat_map(char::to_lowercase).collect())
}

/// The character boundaries of a run of a joined script.
fn boundaries(text: &str, run: &Run) -> Vec<usize> {
    let mut at: Vec<usize> = text[run.from..run.to].char_indices().map(|(i, _)| run.from + i).collect();
    at.push(run.to);
    at
}

/// The words `text` is indexed under, in order, with their offsets.
fn index_tokens(text: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut push = |from: usize, to: usize, word: String| {
        let position = tokens.len();
        tokens.push(Token { offset_from: from, offset_to: to, position, text: word, position_length: 1 });
    };
    for run in runs(text) {
        if !run.joined {
            if let Some(word) = spaced_word(text, &run) {
                push(run.from, run.to, word);
            }
            continue;
        }
        let at = boundaries(text, &run);
        for i in 0..at.len() - 1 {
            push(at[i], at[i + 1], text[at[i]..at[i + 1]].to_owned());
            if let Some(&to) = at.get(i + 2) {
                push(at[i], to, text[at[i]..to].to_owned());
            }
        }
    }
    tokens
}

/// The distinct words a query for `text` asks for, each of which a hit must hold.
pub fn query_words(text: &str) -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    for run in runs(text) {
        let found: Vec<String> = if run.joined {
            let at = boundaries(text, &run);
            if at.len() == 2 {
                vec![text[run.from..run.to].to_owned()]
            } else {
                at.windows(3).map(|w| text[w[0]..w[2]].to_owned()).collect()
            }
        } else {
            spaced_word(text, &run).into_iter().collect()
        };
        for word in found {
            if !words.contains(&word) {
                words.push(word);
            }
        }
    }
    words
}

/// The index's analyzer (see the module's documentation).
#[derive(Debug, Clone, Default)]
pub struct Words;

/// The words of one text.
pub struct WordStream {
    tokens: Vec<Token>,
    next: usize,
}

impl Tokenizer for Words {
    type TokenStream<'a> = WordStream;

    fn token_stream<'a>(&'a mut self, text: &'a str) -> WordStream {
        WordStream { tokens: index_tokens(text), next: 0 }
    }
}

impl TokenStream for WordStream {
    fn advance(&mut self) -> bool {
        self.next += 1;
        self.next <= self.tokens.len()
    }

    fn token(&self) -> &Token {
        &self.tokens[self.next - 1]
    }

    fn token_mut(&mut self) -> &mut Token {
        &mut self.tokens[self.next - 1]
    }
}

#[cfg(test)]
mod tests {
    use tantivy::tokenizer::TextAnalyzer;

    use super::*;

    fn indexed(text: &str) -> Vec<String> {
        let mut analyzer = TextAnalyzer::from(Words);
        let mut stream = analyzer.token_stream(text);
        let mut words = Vec::new();
        while stream.advance() {
            words.push(stream.token().text.clone());
        }
        words
    }

    /// Text of the space-separated scripts gets exactly the words tantivy's default analyzer
    /// gave it, at the same offsets, so documents indexed before keep matching.
    #[test]
    fn spaced_scripts_are_split_as_tantivys_default_analyzer_splits_them() {
        let samples = [
            "Heat (1995) — the diner scene; De Niro & Pacino!",
            "Amélie's ÉTÉ: Ça va, Straße, İstanbul, ΣΊΣΥΦΟΣ",
            "Сталкер, Солярис — Тарковский 1979",
            "word_with_underscores dash-joined 3.14 ٣٤ الفيلم",
            "a-very-long-but-split word and onewordthatislongerthanfortybytesforsure!",
            "",
            "   \t\n",
        ];
        let default = tantivy::tokenizer::TokenizerManager::default();
        for sample in samples {
            let mut theirs = default.get("default").unwrap();
            let mut stream = theirs.token_stream(sample);
            let mut expected = Vec::new();
            while stream.advance() {
                let t = stream.token();
                expected.push((t.text.clone(), t.offset_from, t.offset_to));
            }
            let ours: Vec<_> = index_tokens(sample).into_iter().map(|t| (t.text, t.offset_from, t.offset_to)).collect();
            assert_eq!(ours, expected, "{sample:?}");
            let asked: Vec<String> = expected.into_iter().map(|(word, _, _)| word).fold(Vec::new(), |mut v, w| {
                if !v.contains(&w) {
                    v.push(w);
                }
                v
            });
            assert_eq!(query_words(sample), asked, "{sample:?}");
        }
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
    }

    #[test]
    fn a_query_asks_for_each_pair_or_the_lone_character() {
        assert_eq!(query_words("千と千尋"), ["千と", "と千", "千尋"]);
        assert_eq!(query_words("侍"), ["侍"]);
        assert_eq!(query_words("Heat 侍 神隠し heat"), ["heat", "侍", "神隠", "隠し"]);
        assert_eq!(query_words("ＣＯＷＢＯＹ ビバップ"), ["ｃｏｗｂｏｙ", "ビバ", "バッ", "ップ"]);
        // Every pair a query asks for of a text is indexed for that text.
        let text = "ハウルの動く城を映画館で観た";
        let held = indexed(text);
        assert!(query_words(text).iter().all(|w| held.contains(w)));
        assert!(query_words("動く城").iter().all(|w| held.contains(w)));
    }
}

//! Document sources, all streaming (one document in memory at a time):
//!
//! - [`default_corpus`]: Vim's help files from Debian's `vim-runtime` package
//!   (`/usr/share/vim/vim*/doc/*.txt`): 151 real documents from a few hundred bytes to 1.6 MB
//!   (≈ 400k BPE tokens) — the long tail long-context training needs. Licence: the Open
//!   Publication License v1.0 with no options exercised (Debian: DFSG-free; see
//!   `/usr/share/doc/vim-runtime/copyright`).
//! - [`text_directory`]: every regular file of a directory (sorted by name), one document each.
//! - [`jsonl_documents`]: JSON lines `{"text": …}`, fine-tuning pairs `{"prompt": …,
//!   "completion": …}` (the prompt is no training target), or chat `{"messages": [{"role",
//!   "content"}, …]}` (LongAlign's format); a chat becomes `role: content` paragraphs.
//!
//! Malformed input is an error naming the file and the line.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::error::DataError;

/// One document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// Where it came from (`file` or `file:line`).
    pub name: String,
    pub text: String,
    /// A prompt before `text` that is no training target (jsonl `{"prompt", "completion"}`:
    /// the completion is `text`).
    pub prompt: Option<String>,
}

/// Where the default corpus lives.
pub const DEFAULT_CORPUS_GLOB: &str = "/usr/share/vim/vim*/doc/*.txt";

/// The files of the default corpus, sorted; an error says how to install them when missing.
pub fn default_corpus_files() -> Result<Vec<PathBuf>, DataError> {
    let root = Path::new("/usr/share/vim");
    let missing = || {
        DataError::MissingCorpus(format!(
            "no Vim help files at {DEFAULT_CORPUS_GLOB}; install them with `apt-get install -y vim-runtime` (Debian/Ubuntu)"
        ))
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|_| missing())?.flatten() {
        let doc = entry.path().join("doc");
        let is_versioned = entry.file_name().to_string_lossy().starts_with("vim");
        if !is_versioned || !doc.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&doc)
            .map_err(|e| DataError::io(&doc, e))?
            .flatten()
        {
            let path = file.path();
            if path.extension().is_some_and(|e| e == "txt") {
                files.push(path);
            }
        }
    }
    if files.is_empty() {
        return Err(missing());
    }
    files.sort();
    Ok(files)
}

/// The default corpus (see the module docs), streamed.
pub fn default_corpus() -> Result<impl Iterator<Item = Result<Document, DataError>>, DataError> {
    Ok(default_corpus_files()?
        .into_iter()
        .map(|path| read_text_file(&path)))
}

/// Every regular file of `dir`, sorted by name, as one document each, streamed.
pub fn text_directory(
    dir: &Path,
) -> Result<impl Iterator<Item = Result<Document, DataError>>, DataError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.is_file())
        .collect();
    if files.is_empty() {
        return Err(DataError::io(dir, "the directory holds no files"));
    }
    files.sort();
    Ok(files.into_iter().map(|path| read_text_file(&path)))
}

/// Reads a UTF-8 text file; invalid UTF-8 is an error naming the line.
pub fn read_text_file(path: &Path) -> Result<Document, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        DataError::Malformed {
            path: path.to_path_buf(),
            line,
            reason: format!("invalid UTF-8 at byte {at}"),
        }
    })?;
    Ok(Document {
        name: path.display().to_string(),
        text,
        prompt: None,
    })
}

/// Documents of a JSON-lines file, streamed line by line (blank lines are skipped).
pub fn jsonl_documents(
    path: &Path,
) -> Result<impl Iterator<Item = Result<Document, DataError>>, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let path = path.to_path_buf();
    Ok(BufReader::new(file)
        .lines()
        .enumerate()
        .filter_map(move |(index, line)| {
            let line_number = index + 1;
            let malformed = |reason: String| DataError::Malformed {
                path: path.clone(),
                line: line_number,
                reason,
            };
            let line = match line {
                Ok(line) => line,
                Err(e) => return Some(Err(malformed(format!("cannot read the line: {e}")))),
            };
            if line.trim().is_empty() {
                return None;
            }
            Some(
                parse_jsonl_line(&line)
                    .map_err(malformed)
                    .map(|(prompt, text)| Document {
                        name: format!("{}:{line_number}", path.display()),
                        text,
                        prompt,
                    }),
            )
        }))
}

/// `{"text": "…"}`, `{"prompt": "…", "completion": "…"}` or `{"messages": [{"role": "…",
/// "content": "…"}, …]}` → the document's prompt (no training target) and text.
fn parse_jsonl_line(line: &str) -> Result<(Option<String>, String), String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let object = value.as_object().ok_or("expected a JSON object per line")?;
    if let Some(text) = object.get("text") {
        return text
            .as_str()
            .map(|text| (None, text.to_string()))
            .ok_or_else(|| "\"text\" must be a string".to_string());
    }
    if object.contains_key("prompt") || object.contains_key("completion") {
        let field = |name: &str| {
            object.get(name).and_then(|v| v.as_str()).ok_or_else(|| {
                format!("a prompt/completion line needs string fields \"prompt\" and \"completion\" (\"{name}\" is missing or not a string)")
            })
        };
        return Ok((
            Some(field("prompt")?.to_string()),
            field("completion")?.to_string(),
        ));
    }
    let messages = object
        .get("messages")
        .ok_or("expected a \"text\" string, \"prompt\" and \"completion\" strings, or a \"messages\" array")?
        .as_array()
        .ok_or("\"messages\" must be an array")?;
    let mut text = String::new();
    for (index, message) in messages.iter().enumerate() {
        let field = |name: &str| {
            message.get(name).and_then(|v| v.as_str()).ok_or_else(|| {
                format!("message {index} needs string fields \"role\" and \"content\"")
            })
        };
        let (role, content) = (field("role")?, field("content")?);
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(role);
        text.push_str(": ");
        text.push_str(content);
    }
    Ok((None, text))
}

/// Documents from `spec`: `default`, a directory of text files, or a `.jsonl` file.
pub fn open_documents(
    spec: &str,
) -> Result<Box<dyn Iterator<Item = Result<Document, DataError>>>, DataError> {
    if spec == "default" {
        return Ok(Box::new(default_corpus()?));
    }
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(Box::new(text_directory(path)?));
    }
    if path.extension().is_some_and(|e| e == "jsonl") {
        return Ok(Box::new(jsonl_documents(path)?));
    }
    if path.is_file() {
        return Ok(Box::new(std::iter::once(read_text_file(path))));
    }
    Err(DataError::Invalid(format!(
        "corpus '{spec}' is not 'default', a directory, a .jsonl file or a text file"
    )))
}

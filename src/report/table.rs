//! Tables that print two ways: markdown for `report.md`, aligned columns for the terminal.

/// A table of preformatted cells; the first column is left-aligned, the rest right-aligned
/// (they are numbers).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: AsRef<str>>(headers: &[S]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.as_ref().to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells read `-`, extra cells are a programming error caught here.
    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert!(cells.len() <= self.headers.len(), "more cells than columns");
        let mut cells = cells;
        cells.resize(self.headers.len(), "-".into());
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut s = line(&self.headers);
        let rule: Vec<String> = (0..self.headers.len())
            .map(|i| if i == 0 { "---".into() } else { "---:".into() })
            .collect();
        s += &line(&rule);
        for r in &self.rows {
            s += &line(r);
        }
        s
    }

    pub fn terminal(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.headers[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, &w))| {
                    if i == 0 {
                        format!("{c:<w$}")
                    } else {
                        format!("{c:>w$}")
                    }
                })
                .collect();
            format!("{}\n", padded.join("  ").trim_end())
        };
        let mut s = line(&self.headers);
        s += &format!(
            "{}\n",
            "-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len().max(1) - 1))
        );
        for r in &self.rows {
            s += &line(r);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_and_terminal_forms() {
        let mut t = Table::new(&["mode", "tokens/s"]);
        t.row(vec!["fp32".into(), "51700".into()]);
        t.row(vec!["bf16-mixed".into()]);
        assert_eq!(
            t.markdown(),
            "| mode | tokens/s |\n| --- | ---: |\n| fp32 | 51700 |\n| bf16-mixed | - |\n"
        );
        let term = t.terminal();
        let lines: Vec<&str> = term.lines().collect();
        assert_eq!(lines[0], "mode        tokens/s");
        assert_eq!(lines[2], "fp32           51700");
        assert_eq!(lines[3], "bf16-mixed         -");
    }
}

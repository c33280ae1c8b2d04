//! Slurm host lists (`SLURM_JOB_NODELIST`: `n[1-3,7],gpu01`) expanded
//! into node names, in their order, as `scontrol show hostnames` does.

/// The node names of host list `list`: comma-separated items, each a name
/// with bracketed ranges (`n[01-03,7]`, zero padding kept; several
/// brackets multiply: `r[1-2]n[1-2]`).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' if depth > 0 => depth -= 1,
            ']' => return Err(format!("host list {list:?}: ']' without '['")),
            ',' if depth == 0 => {
                item(&list[start..i], &mut names)?;
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("host list {list:?}: '[' without ']'"));
    }
    item(&list[start..], &mut names)?;
    Ok(names)
}

/// Appends the names of one item (`n[1-3]x`) to `names`.
fn item(item: &str, names: &mut Vec<String>) -> Result<(), String> {
    let item = item.trim();
    if item.is_empty() {
        return Ok(());
    }
    let Some(open) = item.find('[') else {
        names.push(item.to_string());
        return Ok(());
    };
    let close = open + item[open..].find(']').ok_or("unclosed '['")?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut tails = Vec::new();
    item_or_self(rest, &mut tails)?;
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let bad = || format!("host list range {range:?} in {item:?}");
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if a > b || b - a > 100_000 {
            return Err(bad());
        }
        for n in a..=b {
            for t in &tails {
                names.push(format!("{prefix}{n:0width$}{t}", width = lo.len()));
            }
        }
    }
    Ok(())
}

/// The names `rest` (after a bracket) expands to; `[""]` when empty.
fn item_or_self(rest: &str, out: &mut Vec<String>) -> Result<(), String> {
    if rest.is_empty() {
        out.push(String::new());
        Ok(())
    } else {
        item(rest, out)
    }
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn lists() {
        let e = |s: &str| expand(s).unwrap();
        assert_eq!(e("n1"), ["n1"]);
        assert_eq!(e("n[2-3]"), ["n2", "n3"]);
        assert_eq!(e("n[1,3],gpu7"), ["n1", "n3", "gpu7"]);
        assert_eq!(e("c[08-10]"), ["c08", "c09", "c10"]);
        assert_eq!(e("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(e(""), Vec::<String>::new());
        for bad in ["n[1-", "n]", "n[3-1]", "n[a]"] {
            assert!(expand(bad).is_err(), "{bad}");
        }
    }
}

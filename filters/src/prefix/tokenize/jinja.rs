//! The template language as Hugging Face runs chat templates, on minijinja:
//! `trim_blocks` and `lstrip_blocks`, `raise_exception`, `strftime_now` (over
//! a time the caller sets, since this crate reads no clock), a
//! Python-compatible `tojson`, the Python `str` and `dict` methods templates
//! call, and JSON objects whose keys iterate in the client's order.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

use super::json::Json;
use super::TokenizeError;

fn tpl_err(e: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Template(e.to_string())
}

/// The name the chat template is registered under.
pub(super) const TEMPLATE: &str = "chat";

/// A JSON object as a template map whose keys iterate in the client's order.
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }
}

pub(super) fn json_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or_default()),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(v) => Value::from(v.iter().map(json_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_object(OrderedMap(
            o.iter().map(|(k, v)| (k.clone(), json_value(v))).collect(),
        )),
    }
}

pub(super) fn build_env(
    source: String,
    now_unix: Arc<AtomicI64>,
) -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    // Hugging Face renders with trim_blocks and lstrip_blocks on.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", move |fmt: String| -> String {
        strftime(now_unix.load(Ordering::Relaxed), &fmt)
    });
    env.add_filter("tojson", tojson);
    env.set_unknown_method_callback(pycompat);
    env.add_template_owned(TEMPLATE, source).map_err(tpl_err)?;
    Ok(env)
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)` as Hugging Face's
/// `tojson` filter does (keys in insertion order).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn dump(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > 64 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => {
            let s = serde_json::to_string(v.as_str().unwrap_or_default())
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            out.push_str(&s);
        }
        ValueKind::Map => {
            out.push('{');
            let mut first = true;
            for k in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                dump(&Value::from(k.to_string()), None, depth + 1, out)?;
                out.push_str(": ");
                dump(&v.get_item(&k)?, indent, depth + 1, out)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            let mut first = true;
            for item in v.try_iter()? {
                if !first {
                    out.push_str(sep);
                }
                first = false;
                newline(out, depth + 1);
                dump(&item, indent, depth + 1, out)?;
            }
            if !first {
                newline(out, depth);
            }
            out.push(']');
        }
        _ => dump(&Value::from(v.to_string()), indent, depth, out)?,
    }
    Ok(())
}

/// The Python `str` and `dict` methods chat templates call.
fn pycompat(_: &State, v: &Value, name: &str, args: &[Value]) -> Result<Value, Error> {
    let arg = |i: usize| args.get(i).and_then(|a| a.as_str()).map(str::to_owned);
    if let Some(s) = v.as_str() {
        let chars: Option<Vec<char>> = arg(0).map(|c| c.chars().collect());
        let trim = |c: char| {
            chars
                .as_ref()
                .map_or(c.is_whitespace(), |set| set.contains(&c))
        };
        return Ok(match name {
            "strip" => Value::from(s.trim_matches(trim)),
            "lstrip" => Value::from(s.trim_start_matches(trim)),
            "rstrip" => Value::from(s.trim_end_matches(trim)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" | "capitalize" => {
                let mut c = s.chars();
                Value::from(c.next().map_or(String::new(), |f| {
                    f.to_uppercase()
                        .chain(c.flat_map(char::to_lowercase))
                        .collect()
                }))
            }
            "startswith" => Value::from(arg(0).is_some_and(|p| s.starts_with(p.as_str()))),
            "endswith" => Value::from(arg(0).is_some_and(|p| s.ends_with(p.as_str()))),
            "replace" => match (arg(0), arg(1)) {
                (Some(a), Some(b)) => Value::from(s.replace(a.as_str(), &b)),
                _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
            },
            "split" => match arg(0) {
                Some(sep) => {
                    Value::from(s.split(sep.as_str()).map(Value::from).collect::<Vec<_>>())
                }
                None => Value::from(s.split_whitespace().map(Value::from).collect::<Vec<_>>()),
            },
            _ => return Err(Error::new(ErrorKind::UnknownMethod, format!("str.{name}"))),
        });
    }
    if v.kind() == ValueKind::Map {
        return Ok(match name {
            "items" => Value::from(
                v.try_iter()?
                    .map(|k| Ok(Value::from(vec![k.clone(), v.get_item(&k)?])))
                    .collect::<Result<Vec<_>, Error>>()?,
            ),
            "keys" => Value::from(v.try_iter()?.collect::<Vec<_>>()),
            "values" => Value::from(
                v.try_iter()?
                    .map(|k| v.get_item(&k))
                    .collect::<Result<Vec<_>, Error>>()?,
            ),
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                match v.get_item(&key) {
                    Ok(x) if !x.is_undefined() => x,
                    _ => args.get(1).cloned().unwrap_or_default(),
                }
            }
            _ => return Err(Error::new(ErrorKind::UnknownMethod, format!("dict.{name}"))),
        });
    }
    Err(Error::new(ErrorKind::UnknownMethod, name.to_owned()))
}

/// A small `strftime` over a Unix time in UTC: `%d %m %Y %y %b %B %a %A %H %M
/// %S %j %%`; other directives are kept verbatim.
fn strftime(unix: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        assert_eq!(
            strftime(1_722_000_309, "%d %b %Y %H:%M:%S %A %j %y %B %%"),
            "26 Jul 2024 13:25:09 Friday 208 24 July %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
    }
}

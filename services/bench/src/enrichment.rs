//! Scenario 7: enrichment and the wrap-up. A 1,000-film year is imported (1,000 catalog films,
//! each watched once in 2024) into a write service alone; then a handlers process running only
//! `movie-enrichment` (the offline catalog) works through the 1,000 `MovieDiscovered` events, and
//! a handlers process running only `wrap-up` computes the year and stores its card.
//!
//! Baselines, measured in the same run: the catalog's own lookups in-process (what enrichment
//! costs without the delivery and the writes around it), and one `GetWrapUpInputs` call (reading
//! the year's diary and profiles through the API, which the wrap-up needs to do at least once).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use reelay_contracts::v1;
use reelay_enrichment::{Catalog, MetadataProvider, MovieQuery};
use reelay_harness::query_strings;

use crate::Bench;
use crate::report::Report;
use crate::scenarios::{scratch, start_quiet};

const FILMS: usize = 1000;

/// `FILMS` distinct catalog films spread over the catalog, as a Letterboxd diary of 2024.
fn diary(catalog: &Catalog) -> (String, Vec<(String, i32)>) {
    let mut seen = HashSet::new();
    let step = catalog.len() / FILMS;
    let films: Vec<(String, i32)> = catalog
        .titles()
        .step_by(step.max(1))
        .filter(|(title, year)| seen.insert((title.to_lowercase(), *year)))
        .take(FILMS)
        .map(|(title, year)| (title.to_owned(), year))
        .collect();
    let mut csv = String::from("Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n");
    for (i, (title, year)) in films.iter().enumerate() {
        let day = format!("2024-{:02}-{:02}", i % 12 + 1, i % 28 + 1);
        let stars = ["", "2", "3", "3.5", "4", "4.5", "5"][i % 7];
        let _ =
            writeln!(csv, "{day},\"{}\",{year},https://boxd.it/b{i:05},{stars},,,{day}", title.replace('"', "\"\""));
    }
    (csv, films)
}

pub async fn enrichment_and_wrap_up(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    eprintln!("enrichment and wrap-up");
    let catalog = Catalog::shared();
    let (csv, films) = diary(&catalog);
    anyhow::ensure!(films.len() == FILMS, "the catalog gave {} distinct films", films.len());

    // Baseline: the same lookups in-process.
    let started = Instant::now();
    let mut known = 0;
    for (title, year) in &films {
        let query = MovieQuery { external_id: None, title: title.clone(), year: *year };
        known += usize::from(catalog.movie(&query).await.map_err(anyhow::Error::msg)?.is_some());
    }
    let lookups = FILMS as f64 / started.elapsed().as_secs_f64();

    let dir = scratch()?;
    let db = dir.path().join("reelay.db");
    let mut write = start_quiet(b, &db, &["write"], &[]).await;
    let mut c = write.clients().await;
    let user = c.user("bench").await;
    let imported = c.import(&user, csv.as_bytes()).await?;
    anyhow::ensure!(imported.imported as usize == FILMS, "imported {} of {FILMS}", imported.imported);

    let handlers_env = |handler: &str| {
        vec![
            ("REELAY_WRITE_URL".to_owned(), format!("http://{}", write.addr)),
            ("REELAY_HANDLERS".into(), handler.into()),
        ]
    };
    let mut enricher =
        start_quiet(b, &dir.path().join("enrich/x.db"), &["handlers"], &handlers_env("movie-enrichment")).await;
    let started = Instant::now();
    loop {
        let pending = query_strings(&db, "SELECT COUNT(*) || '' FROM movies WHERE enrichment = 'pending'").await[0][0]
            .parse::<usize>()?;
        if pending == 0 {
            break;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(600), "{pending} films still pending after 10 minutes");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let enriched = FILMS as f64 / started.elapsed().as_secs_f64();
    enricher.stop().await;
    let found = query_strings(&db, "SELECT COUNT(*) || '' FROM movies WHERE enrichment = 'enriched'").await[0][0]
        .parse::<usize>()?;
    anyhow::ensure!(found == known, "{found} films enriched, the catalog knows {known}");
    report.add("catalog lookups in-process (1,000 films)", lookups, "films/s");
    report
        .add("films enriched from the catalog (backlog of 1,000)", enriched, "films/s")
        .against("catalog lookups in-process", lookups);

    let wrap_up = c
        .wrap_ups
        .request_wrap_up(v1::RequestWrapUpRequest { actor_user_id: user, year: 2024, ..Default::default() })
        .await?
        .into_inner()
        .wrap_up
        .expect("the answer carries the wrap-up");
    let mut inputs_ms = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let inputs = c
            .wrap_ups
            .get_wrap_up_inputs(v1::GetWrapUpInputsRequest { wrap_up_id: wrap_up.wrap_up_id.clone() })
            .await?
            .into_inner();
        anyhow::ensure!(inputs.entries.len() == FILMS, "inputs hold {} entries", inputs.entries.len());
        inputs_ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    inputs_ms.sort_by(f64::total_cmp);
    let mut wrapper = start_quiet(b, &dir.path().join("wrap/x.db"), &["handlers"], &handlers_env("wrap-up")).await;
    let started = Instant::now();
    loop {
        let w =
            c.wrap_ups.get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: wrap_up.wrap_up_id.clone() }).await?.into_inner();
        if w.status() == v1::WrapUpStatus::Completed {
            anyhow::ensure!(w.summary.is_some_and(|s| s.films as usize == FILMS), "the wrap-up counts every film");
            break;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(120), "the wrap-up did not complete in 2 minutes");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let wrap_ms = started.elapsed().as_secs_f64() * 1000.0;
    report.add("GetWrapUpInputs of a 1,000-film year (median of 5)", inputs_ms[2], "ms");
    report
        .add("wrap-up of a 1,000-film year (handler up → completed)", wrap_ms, "ms")
        .against("GetWrapUpInputs, median", inputs_ms[2]);
    wrapper.stop().await;
    write.stop().await;
    Ok(())
}

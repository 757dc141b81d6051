//! The handler registry: the one list of the handlers this build has. Each handler lives in its
//! own crate beside this one (`search/`, `enrichment/`, `wrapup/`, `media/`, `federation/`, `probe/`) and declares its
//! name, the event types it takes (its `Handler`), its settings (a clap args block, environment
//! names prefixed by the handler: `REELAY_SEARCH_*`, `REELAY_ENRICHMENT_*`) and how it is built.
//! Handlers that store files share one object storage setting (`REELAY_OBJECTS_*`).
//!
//! `reelay run --handler X` picks from this list; the write service registers a delivery cursor
//! for each handler listed, so none misses an event written meanwhile; the Kubernetes manifests
//! run one Deployment per name. Adding a handler means adding its crate and one line below.

use std::path::Path;

use anyhow::bail;
use reelay_delivery::{BuiltHandler, HandlerContext};
use reelay_objects::{Objects, ObjectsSettings};

/// The handlers of every build, in order (test builds add the probes).
const HANDLERS: &[&str] =
    &["search", "movie-enrichment", "person-enrichment", "wrap-up", "poster-sync", "image-conversion", "image-cleanup"];

/// Every handler's settings, each in its own block.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct HandlerSettings {
    #[command(flatten)]
    pub objects: ObjectsSettings,
    #[command(flatten)]
    pub search: reelay_search::SearchSettings,
    #[command(flatten)]
    pub enrichment: reelay_enrichment::EnrichmentSettings,
    #[command(flatten)]
    pub media: reelay_media::MediaSettings,
    #[command(flatten)]
    pub federation: reelay_federation::FederationSettings,
    #[command(flatten)]
    pub probe: reelay_probe::ProbeSettings,
}

/// The handlers this build has and these settings enable, in registry order. Test builds add
/// the probe handlers named in `REELAY_PROBE_HANDLERS`.
pub fn names(settings: &HandlerSettings) -> Vec<&'static str> {
    let mut names = HANDLERS.to_vec();
    names.extend(reelay_federation::NAMES);
    names.extend(settings.probe.names());
    names
}

/// The object store the settings name (the local filesystem under `data_dir` by default).
pub fn objects(settings: &HandlerSettings, data_dir: &Path) -> anyhow::Result<Objects> {
    Objects::open(&settings.objects, data_dir)
}

/// Builds the handlers named in `selected` (all of [`names`] when empty).
pub async fn build(
    selected: &[String],
    settings: &HandlerSettings,
    context: &HandlerContext,
) -> anyhow::Result<Vec<BuiltHandler>> {
    let known = names(settings);
    if let Some(unknown) = selected.iter().find(|s| !known.contains(&s.as_str())) {
        bail!("unknown handler {unknown:?}; this build has: {}", known.join(", "));
    }
    // One store for every handler that writes files (it holds a client and its connections).
    let mut store: Option<Objects> = None;
    let mut shared_objects = || -> anyhow::Result<Objects> {
        if store.is_none() {
            let opened = objects(settings, &context.data_dir)?;
            opened.spawn_staging_sweeper();
            store = Some(opened);
        }
        Ok(store.clone().expect("opened above"))
    };
    let mut built = Vec::new();
    for name in known {
        if !selected.is_empty() && !selected.iter().any(|s| s == name) {
            continue;
        }
        built.push(match name {
            "search" => reelay_search::build(&settings.search, context)?,
            "movie-enrichment" => reelay_enrichment::build_movie_enrichment(&settings.enrichment, context)?,
            "person-enrichment" => reelay_enrichment::build_person_enrichment(&settings.enrichment, context)?,
            "wrap-up" => reelay_wrapup::build(context, shared_objects()?),
            "poster-sync" => reelay_media::build_poster_sync(&settings.media, context, shared_objects()?)?,
            "image-conversion" => reelay_media::build_image_conversion(&settings.media, context, shared_objects()?)?,
            "image-cleanup" => reelay_media::build_image_cleanup(shared_objects()?),
            federation if reelay_federation::NAMES.contains(&federation) => {
                reelay_federation::build(federation, &settings.federation, context)?
            }
            probe => {
                let probe = reelay_probe::PROBES.iter().copied().find(|p| *p == probe).expect("names() lists it");
                reelay_probe::build(probe, &settings.probe, context).await?
            }
        });
    }
    Ok(built)
}

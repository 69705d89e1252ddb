//! Scheduling: views, plugins, profiles, registry and the filter config.

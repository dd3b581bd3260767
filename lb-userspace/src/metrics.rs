//! Prometheus / OpenMetrics exporter.
//!
//! Every scrape builds the exposition from the agent's state and the BPF
//! maps at that moment (per-CPU counters summed then), so scraping costs the
//! datapath nothing.

/// Every series lbd exports (metric family names; histograms also expose
/// `_bucket`, `_sum` and `_count`, counters are sampled as `<name>`, which
/// already ends in `_total`).
pub const SERIES: &[&str] = &[
    "lb_backend_connections_total",
    "lb_backend_packets_total",
    "lb_backend_bytes_total",
    "lb_backend_up",
    "lb_backend_weight",
    "lb_backend_effective_weight",
    "lb_backend_active_flows",
    "lb_service_packets_total",
    "lb_service_fairness",
    "lb_dropped_packets_total",
    "lb_kernel_fallback_packets_total",
    "lb_flow_table_entries",
    "lb_health_check_duration_seconds",
    "lb_health_check_failures_total",
    "lb_config_reloads_total",
    "lb_build_info",
];

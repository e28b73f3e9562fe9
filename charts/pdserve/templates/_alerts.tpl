{{/*
The alert rules under which a latency-tuning change should be rolled back, as
Prometheus rule groups. Series carry the pool, role, bucket and mode labels plus the
namespace Prometheus' Kubernetes discovery adds. Latency is read from the router's
series (role="router"): what clients saw, each request counted once; the workers'
own latency histograms would count a request again on every worker it passed.
Engine and hand-off series are the workers'. "Baseline" is the hour that ended
alerts.baselineOffset ago; "now" the last 10 minutes.
*/}}
{{- define "pdserve.alertGroups" -}}
{{- $a := .Values.alerts -}}
{{- $base := printf "[1h] offset %s" $a.baselineOffset -}}
{{- $by := "sum by (namespace, pool)" -}}
{{- $router := "role=\"router\"" -}}
{{- $ttftWithin := printf "pdserve_time_to_first_token_seconds_bucket{%s, le=~\"%v(\\\\.0)?\"}" $router $a.ttftTargetSeconds -}}
- name: pdserve-rollback
  rules:
    - alert: PdserveITLP99AboveTarget
      expr: |
        histogram_quantile(0.99,
          sum by (namespace, pool, le) (rate(pdserve_inter_token_latency_seconds_bucket{ {{- $router -}} }[5m]))
        ) > {{ $a.itlP99Seconds }}
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `P99 inter-token latency of {{ $labels.namespace }}/{{ $labels.pool }} is over target` | quote }}
        description: {{ printf "P99 inter-token latency has been above %vs for 10 minutes: streams stall (larger chunks, more sequences per step, or hand-offs competing with decodes)." $a.itlP99Seconds | quote }}
    - alert: PdservePreemptionsRisingWithTTFT
      expr: |
        (
          {{ $by }} (rate(pdserve_preemptions_total[10m]))
            > 2 * {{ $by }} (rate(pdserve_preemptions_total{{ $base }})) + 0.01
        )
        and on (namespace, pool)
        (
          histogram_quantile(0.95,
            sum by (namespace, pool, le) (rate(pdserve_time_to_first_token_seconds_bucket{ {{- $router -}} }[10m])))
            > 1.5 * histogram_quantile(0.95,
              sum by (namespace, pool, le) (rate(pdserve_time_to_first_token_seconds_bucket{ {{- $router -}} }{{ $base }})))
        )
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `{{ $labels.namespace }}/{{ $labels.pool }} preempts more and answers later` | quote }}
        description: >-
          Preemptions (KV cache full) run at more than twice their baseline rate while P95
          TTFT is 1.5 times its baseline: the KV cache is too small for the new batch or
          chunk settings.
    - alert: PdserveShortRequestsTTFTDoubled
      expr: |
        histogram_quantile(0.95,
          sum by (namespace, pool, le) (rate(pdserve_time_to_first_token_seconds_bucket{ {{- $router }}, bucket=~"{{ $a.shortBuckets }}"}[10m])))
          > 2 * histogram_quantile(0.95,
            sum by (namespace, pool, le) (rate(pdserve_time_to_first_token_seconds_bucket{ {{- $router }}, bucket=~"{{ $a.shortBuckets }}"}{{ $base }})))
        and on (namespace, pool)
        {{ $by }} (rate(pdserve_time_to_first_token_seconds_count{ {{- $router }}, bucket=~"{{ $a.longBuckets }}"}[10m])) > 0
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `Short requests to {{ $labels.namespace }}/{{ $labels.pool }} wait twice as long for their first token` | quote }}
        description: >-
          P95 TTFT of short prompts is twice its baseline while long prompts arrive: long
          prefills hold up short ones (chunk size, or the colocated/disaggregated split).
    - alert: PdserveEngineBusyGoodputFalling
      expr: |
        avg by (namespace, pool) (rate(pdserve_engine_step_duration_seconds_sum[10m])) > {{ $a.engineBusyRatio }}
        and on (namespace, pool)
        (
          {{ $by }} (rate({{ $ttftWithin }}[10m]))
            < 0.8 * {{ $by }} (rate({{ $ttftWithin }}{{ $base }}))
        )
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `Engines of {{ $labels.namespace }}/{{ $labels.pool }} are busy but serve fewer requests in time` | quote }}
        description: {{ printf "Engines step more than %v of the time while requests answered within %vs TTFT fell below 80%% of their baseline rate." $a.engineBusyRatio $a.ttftTargetSeconds | quote }}
    - alert: PdserveRequestErrorsAboveBaseline
      expr: |
        (
          {{ $by }} (rate(pdserve_requests_rejected_total[10m]))
          / ({{ $by }} (rate(pdserve_requests_rejected_total[10m])) + {{ $by }} (rate(pdserve_requests_total[10m])))
        )
        > 2 * (
          ({{ $by }} (rate(pdserve_requests_rejected_total{{ $base }})) or 0 * {{ $by }} (rate(pdserve_requests_total{{ $base }})))
          / (({{ $by }} (rate(pdserve_requests_rejected_total{{ $base }})) or 0 * {{ $by }} (rate(pdserve_requests_total{{ $base }}))) + {{ $by }} (rate(pdserve_requests_total{{ $base }})))
        ) + 0.01
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `{{ $labels.namespace }}/{{ $labels.pool }} refuses more requests than it used to` | quote }}
        description: >-
          The share of requests refused with a 4xx is above twice its baseline (and above 1%).
    - alert: PdserveRequestCancelsAboveBaseline
      expr: |
        (
          {{ $by }} (rate(pdserve_requests_total{finish_reason="abort"}[10m]))
          / {{ $by }} (rate(pdserve_requests_total[10m]))
        )
        > 2 * (
          ({{ $by }} (rate(pdserve_requests_total{finish_reason="abort"}{{ $base }})) or 0 * {{ $by }} (rate(pdserve_requests_total{{ $base }})))
          / {{ $by }} (rate(pdserve_requests_total{{ $base }}))
        ) + 0.01
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: {{ `Clients of {{ $labels.namespace }}/{{ $labels.pool }} give up more often` | quote }}
        description: >-
          The share of requests that ended because the client went away is above twice its
          baseline (and above 1%): answers come too late for them.
    - alert: PdserveKVTransfersFailing
      expr: |
        {{ $by }} (rate(pdserve_kv_transfer_failures_total{role="decode"}[5m]))
        / (
          {{ $by }} (rate(pdserve_kv_transfer_failures_total{role="decode"}[5m]))
          + ({{ $by }} (rate(pdserve_kv_wait_seconds_count{role="decode"}[5m])) or 0 * {{ $by }} (rate(pdserve_kv_transfer_failures_total{role="decode"}[5m])))
        ) > {{ $a.kvTransferFailureRatio }}
      for: 5m
      labels:
        severity: warning
      annotations:
        summary: {{ `KV hand-offs of {{ $labels.namespace }}/{{ $labels.pool }} fail` | quote }}
        description: {{ printf "More than %v of prefill-to-decode hand-offs failed over 5 minutes (see pdserve_kv_transfer_failures_total by reason)." $a.kvTransferFailureRatio | quote }}
    - alert: PdserveDisaggregatedRequestsAllFallingBack
      expr: |
        (
          {{ $by }} (rate(pdserve_kv_transfer_failures_total{role="decode"}[10m])) > 0
          or
          {{ $by }} (rate(pdserve_router_fallbacks_total{ {{- $router -}} }[10m])) > 0
        )
        unless on (namespace, pool)
        {{ $by }} (rate(pdserve_kv_wait_seconds_count{role="decode"}[10m])) > 0
      for: 5m
      labels:
        severity: critical
      annotations:
        summary: {{ `No hand-off of {{ $labels.namespace }}/{{ $labels.pool }} succeeds` | quote }}
        description: >-
          No hand-off succeeded for 10 minutes while disaggregated requests kept coming:
          either every hand-off failed (decode workers then prefill each prompt themselves
          under failurePolicy recompute, or refuse it under fail) or the router found no
          healthy prefill worker and served them colocated without trying one
          (pdserve_router_fallbacks_total reason no_prefill).
{{- end -}}

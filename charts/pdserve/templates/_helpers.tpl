{{/* The release's base name: the release name, with the chart's name unless it holds it. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's objects' name. */}}
{{- define "pdserve.operatorName" -}}
{{- printf "%s-operator" (include "pdserve.fullname" .) -}}
{{- end -}}

{{/* Labels selecting the operator's pod. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object of the chart. */}}
{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches, as a JSON list (empty: all of them). */}}
{{- define "pdserve.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- .Values.watchNamespaces | uniq | toJson -}}
{{- else if .Values.rbac.namespaced -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.workerImage" -}}
{{- with .Values.workerImage.repository -}}
{{- printf "%s:%s" . (default $.Chart.AppVersion $.Values.workerImage.tag) -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does, on the namespaced resources it touches: granted by a
ClusterRole, or by a Role in each watched namespace.
*/}}
{{- define "pdserve.operatorRules" -}}
# The pools: watched; kopf keeps its bookkeeping in their annotations.
- apiGroups: ["pdserve.dev"]
  resources: ["servingpools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pdserve.dev"]
  resources: ["servingpools/status"]
  verbs: ["patch"]
# Every kind of child a pool renders: watched, applied (server-side), pruned.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Each pool's internal credential: created once, never read, changed or adopted (the
# pool's status records it), so the operator can read no Secret at all.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Workers scaled by an HPA or KEDA instead of the operator's planner.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The workers' pods: read for why replicas are not ready.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# The routers' Role grants these; Kubernetes lets only a holder grant them.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# Events about what the operator does.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

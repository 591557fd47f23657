{{/*
The chart name, or nameOverride.
*/}}
{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A fully qualified name for the release's resources: the release name, with the chart name
appended unless the release name already contains it (63 characters: DNS label limit).
*/}}
{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The name of cluster-scoped resources (ClusterRole, ClusterRoleBinding): prefixed with the
release namespace, so that releases of the same name in two namespaces (say one operator
per team, each with its own watchNamespaces) do not claim the same objects.
*/}}
{{- define "shoal.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "shoal.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "shoal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every resource of the release.
*/}}
{{- define "shoal.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end }}

{{/*
Selector labels of the operator (a Deployment's selector is immutable: never add to these).
*/}}
{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The Lease the operator replicas elect their leader on (replicas > 1), in the release
namespace.
*/}}
{{- define "shoal.leaseName" -}}
{{- printf "%s-operator" (include "shoal.fullname" .) }}
{{- end }}

{{/*
The operator's ServiceAccount. Without create, an existing one, which must be named: the
namespace's `default` would run the operator and be bound to its ClusterRole (`get` on
Secrets), and so would every other pod running as `default` there.
*/}}
{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "shoal.fullname" .)) .Values.serviceAccount.name }}
{{- else if .Values.serviceAccount.name }}
{{- .Values.serviceAccount.name }}
{{- else }}
{{- fail "serviceAccount.create is false but serviceAccount.name is empty: name the existing ServiceAccount the operator runs as (the chart binds the operator's roles to it; it will not bind them to the namespace's default ServiceAccount)" }}
{{- end }}
{{- end }}

{{/*
The image, repository@digest when image.digest is set, else repository:tag (the operator
hands the same string to consumer pods).
*/}}
{{- define "shoal.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}
{{- end }}

{{/*
The operator's permissions on ConsumerGroups and the children it applies, for a
ClusterRole (whole cluster) or a Role per watched namespace.

The operator creates a Role for each group's pods (get the group; get/patch/update its
scale; create/patch Events; get/list/patch pods). Kubernetes refuses to create a Role
granting what its creator does not hold (RBAC escalation prevention), so the operator
holds those permissions itself rather than the broader `escalate` and `bind` verbs.
*/}}
{{- define "shoal.operatorRules" -}}
# kopf watches the groups, patches them (its finalizer, progress annotations), writes status.
- apiGroups: ["shoal.dev"]
  resources: ["consumergroups"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["shoal.dev"]
  resources: ["consumergroups/status"]
  verbs: ["get", "patch", "update"]
# Held because the groups' Roles grant it (see above); the operator itself does not use it.
- apiGroups: ["shoal.dev"]
  resources: ["consumergroups/scale"]
  verbs: ["get", "patch", "update"]
# Children carry ownerReferences with blockOwnerDeletion: with the
# OwnerReferencesPermissionEnforcement admission plugin that needs update on finalizers.
- apiGroups: ["shoal.dev"]
  resources: ["consumergroups/finalizers"]
  verbs: ["update"]
# The children, by server-side apply (create or patch); the Deployment's status is read
# into the group's. Deleting a group deletes its Deployment first (its finalizer waits for
# the consumers to leave before clearing etcd).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments/status"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update"]
# Events on the groups (kopf posts core Events); events.k8s.io because the groups' Roles
# grant it.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# The operator counts a deleted group's pods, and lists a group's pods while its
# Deployment has some not ready (pods the scheduler refuses: the MembersSchedulable
# condition); no watch. patch is held because the groups' Roles grant it (the leader
# sets pod-deletion-cost on its members).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "patch"]
{{- end }}

{{/*
A group's spec.etcd.tlsSecret, spec.nats.tlsSecret and spec.nats.credentialsSecret: the
operator reads them by name to reach the group's etcd (status, and clearing etcd on
deletion) and NATS (the group's stream and durables, status). Only get: it never lists or watches Secrets, so
it reads only those the groups name. That is as far as RBAC goes: it cannot follow what
each group names, and the operator cannot grant itself a per-group Role for the named
Secret (escalation prevention: it would need to hold that get already). resourceNames
narrows it when the platform fixes the names (rbac.secretNames); watchNamespaces confines
it to those namespaces.
*/}}
{{- define "shoal.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
  {{- with .Values.rbac.secretNames }}
  resourceNames:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
What kopf needs cluster-wide in every mode: it discovers resources by watching CRDs, and
with a namespace list it watches namespaces to serve them as they come and go.
*/}}
{{- define "shoal.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}

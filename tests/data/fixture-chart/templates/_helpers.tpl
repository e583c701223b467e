{{/* The post-renderer's annotation contract: the base scheduling fields and the merge inputs. */}}
{{- define "fixture.scheduling" -}}
gpu.metax-tech.com/component: {{ .key }}
gpu.metax-tech.com/scheduling-base: {{ pick .spec "nodeSelector" "affinity" "tolerations" | toJson | quote }}
gpu.metax-tech.com/scheduling-inputs: {{ dict "global" (.root.Values.podTemplateSpec | default nil) "component" ((get .root.Values .key).podTemplateSpec | default nil) "tolerations" (.root.Values.tolerations | default nil) | toJson | quote }}
{{- end }}

# phoenix_pubsub's own suite for adapters, test/shared/pubsub_test.exs (MIT
# licence, copyright (c) 2014 Chris McCord; see LICENSE.md in phoenix_pubsub),
# run against this adapter. It is loaded from the phoenix_pubsub dependency in
# use (Hex's package ships test/shared; `make phoenix` uses the vendored copy),
# so the suite always matches the version the adapter is built against. It
# defines Phoenix.PubSubTest, which reads the adapter from this setting.
Application.put_env(:phoenix_pubsub, :test_adapter, {Phoenix.PubSub.Convoy, []})

Code.require_file("test/shared/pubsub_test.exs", Mix.Project.deps_paths()[:phoenix_pubsub])

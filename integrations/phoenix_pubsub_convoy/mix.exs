defmodule PhoenixPubsubConvoy.MixProject do
  use Mix.Project

  def project do
    [
      app: :phoenix_pubsub_convoy,
      version: "0.1.0",
      elixir: "~> 1.14",
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: deps(),
      # test_helper.exs makes this node distributed and then starts the
      # applications: convoy must start on a node that already has its name.
      aliases: [test: "test --no-start"]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  # test/support holds the modules the peer nodes run (subscribers, a tracker):
  # compiled into this project's ebin, which the peers get with -pa.
  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  # convoy is this repository, compiled with rebar3 (set MIX_REBAR3).
  # phoenix_pubsub comes from Hex, unless PHOENIX_PUBSUB_PATH names a checkout of
  # it (`make phoenix` points it at the vendored copy beside the repository, for
  # machines without Hex); the version requirement holds either way.
  defp deps do
    [
      {:convoy, path: "../..", manager: :rebar3},
      phoenix_pubsub()
    ]
  end

  defp phoenix_pubsub do
    case System.get_env("PHOENIX_PUBSUB_PATH", "") do
      "" -> {:phoenix_pubsub, "~> 2.1"}
      path -> {:phoenix_pubsub, "~> 2.1", path: path}
    end
  end
end

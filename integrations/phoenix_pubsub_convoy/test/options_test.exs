defmodule Phoenix.PubSub.ConvoyOptionsTest do
  # The adapter's own options are checked where the PubSub is started.
  use ExUnit.Case, async: true

  alias Phoenix.PubSub.Convoy

  defp spec(opts), do: Convoy.child_spec([name: :n, adapter_name: :"n.Adapter"] ++ opts)

  test "overload is :drop, :error, :block or :settings" do
    for policy <- [:drop, :error, :block, :settings], do: assert(%{} = spec(overload: policy))

    assert_raise ArgumentError, ~r/invalid :overload option :wait/, fn ->
      spec(overload: :wait)
    end
  end

  test "block_timeout goes with overload: :block, from 0 to 3600000 ms" do
    assert %{} = spec(overload: :block, block_timeout: 0)
    assert %{} = spec(overload: :block, block_timeout: 3_600_000)

    assert_raise ArgumentError, ~r/invalid :block_timeout option -1/, fn ->
      spec(overload: :block, block_timeout: -1)
    end

    assert_raise ArgumentError, ~r/needs overload: :block/, fn -> spec(block_timeout: 100) end
  end

  test "a bad option stops the PubSub from starting, naming it", %{test: test} do
    assert {:error, {{%ArgumentError{message: message}, _}, _}} =
             start_supervised({Phoenix.PubSub, name: test, adapter: Convoy, overload: :wait})

    assert message =~ ":overload"
  end

  test "pool_size below broadcast_pool_size is refused, as PG2 refuses it", %{test: test} do
    assert {:error, {{:shutdown, {:failed_to_start_child, Convoy, message}}, _}} =
             start_supervised(
               {Phoenix.PubSub, name: test, adapter: Convoy, pool_size: 1, broadcast_pool_size: 2}
             )

    assert message =~ "pool_size"
  end
end

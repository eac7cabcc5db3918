%% @private
%% Where each node's runtime (the settings with the node's own lanes and their
%% admission counters) is published, by `convoy_control', and read, by senders
%% (`convoy_lanes'). A connected node's is in the settings' runtime (`rows'),
%% which a send reads anyway (one read of an atom key); any other's (a node sent
%% to before it connects, a hidden one, one that went down) under a key of its
%% own (reading a tuple key hashes it: about 12 ns more). A node's runtime is put
%% under its own key before it leaves the settings' (and taken off only after it
%% is there), so a sender always finds it.
%%
%% Not one table of every node's: publishing it each time a node got lanes
%% copied it whole into the literal area each time (3,000 node names sent to
%% exhausted it); connected nodes are few and change seldom.
-module(convoy_runtimes).

-export([publish/2, publish_node/3, unpublish_node/3, erase_nodes/1, erase/1, row/1, rows/0]).

-include("convoy_runtime.hrl").

%% @doc Publish the settings' runtime `RT' with every node's in `Rows'.
-spec publish(#runtime{}, #{node() => #runtime{}}) -> ok.
publish(RT, Rows) ->
    Connected = maps:with(erlang:nodes(), Rows),
    Own = maps:without(maps:keys(Connected), Rows),
    maps:foreach(fun(Node, Row) -> persistent_term:put({?RUNTIME_KEY, Node}, Row) end, Own),
    persistent_term:put(?RUNTIME_KEY, RT#runtime{rows = Connected}),
    _ = [persistent_term:erase({?RUNTIME_KEY, Node}) || Node <- maps:keys(Connected)],
    ok.

%% @doc `publish/2' for `Node''s runtime alone, which changed (started, a lane
%% replaced): the other nodes' keys stay as they are.
-spec publish_node(node(), #runtime{}, #{node() => #runtime{}}) -> ok.
publish_node(Node, RT, Rows) ->
    case lists:member(Node, erlang:nodes()) of
        true ->
            persistent_term:put(?RUNTIME_KEY, RT#runtime{rows = maps:with(erlang:nodes(), Rows)});
        false ->
            persistent_term:put({?RUNTIME_KEY, Node}, maps:get(Node, Rows))
    end.

%% @doc `Node''s runtime goes (the node was forgotten; `Rows', the others):
%% from the settings' too if it is still there (its `nodedown' not seen yet).
-spec unpublish_node(node(), #runtime{}, #{node() => #runtime{}}) -> ok.
unpublish_node(Node, RT, Rows) ->
    _ = case persistent_term:get(?RUNTIME_KEY, undefined) of
            #runtime{rows = #{Node := _}} -> publish(RT, Rows);
            _ -> ok
        end,
    _ = persistent_term:erase({?RUNTIME_KEY, Node}),
    ok.

%% @doc The nodes' runtimes under keys of their own that a start of convoy
%% (`Generation') published, or `all' of them (a start: what a previous one
%% left if it ended without its stop).
-spec erase_nodes(pos_integer() | all) -> ok.
erase_nodes(Generation) ->
    _ = [persistent_term:erase(K) || {K = {?RUNTIME_KEY, _}, #runtime{generation = G}}
                                         <- persistent_term:get(),
                                     Generation =:= all orelse G =:= Generation],
    ok.

%% @doc Everything a start of convoy (`Generation') published goes, the
%% settings' runtime too unless a later start published its own.
-spec erase(pos_integer()) -> ok.
erase(Generation) ->
    ok = erase_nodes(Generation),
    _ = case persistent_term:get(?RUNTIME_KEY, undefined) of
            #runtime{generation = Generation} -> persistent_term:erase(?RUNTIME_KEY);
            _ -> ok
        end,
    ok.

%% @doc `Node''s runtime, or `undefined' while it has no lanes.
-spec row(node()) -> #runtime{} | undefined.
row(Node) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{rows = #{Node := Row}} -> Row;
        _ -> persistent_term:get({?RUNTIME_KEY, Node}, undefined)
    end.

%% @doc Every node's runtime, by node (reads all of persistent_term: for
%% operators and tests, not for a send).
-spec rows() -> [{node(), #runtime{}}].
rows() ->
    Connected = case persistent_term:get(?RUNTIME_KEY, undefined) of
                    #runtime{rows = Rows} -> maps:to_list(Rows);
                    undefined -> []
                end,
    lists:sort(Connected ++ [{Node, Row} || {{?RUNTIME_KEY, Node}, Row = #runtime{}}
                                                <- persistent_term:get()]).

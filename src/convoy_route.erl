%% @private
%% The entry points of `convoy:send/2,3', `send_many/1', `multicast/2' and
%% `batch/1': runs in the caller's process, resolves destinations (local ones are
%% sent at once, as `!' sends them) and groups remote ones by node. Each remote
%% message then takes its path in `convoy_send' (the facts, `convoy_path''s
%% decision, the admission bracket).
%%
%% Inside `convoy:batch/1', `send/2' (and `cast/2', which sends through it) to a
%% remote destination and `multicast/2''s remote part are checked at once and
%% collected in the caller's scope (`convoy_scope'); they leave in their order
%% when the scope ends, by returning or by an exception (then re-raised): runs of
%% sends as one `send_many/1', each multicast in its place. `convoy' has them
%% leave earlier before the calls that must come behind them (`leave/0'), and
%% they leave whenever `max_batch' are collected, so a scope's memory is bounded
%% as a lane's batch is.
-module(convoy_route).

-export([send/2, send/3, send_remote/3, send_many/1, many/2, multicast/2, multicast/3,
         multicast_remote/2, multicast_entry/3, batch/1, leave/0]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").

-compile({inline, [resolve/1, local_or_remote/2, with_opts/2]}).

%% @doc See `convoy:send/2'.
-spec send(convoy:dest(), term()) -> ok.
send(Pid, Msg) when is_pid(Pid) ->
    %% one read of the pid's node serves the local test and the remote send
    case node(Pid) of
        Node when Node =:= node() ->
            Pid ! Msg, % local: exactly `!', nothing else to decide
            ok;
        Node ->
            send_remote(Node, Pid, Msg)
    end;
send(Name, Msg) when is_atom(Name) ->
    Name ! Msg,
    ok;
send(Dest, Msg) ->
    case convoy_scope:is_open() andalso resolve(Dest) of
        {remote, Node, Dest} -> collected(convoy_scope:collect_send(Node, Dest, Msg)); % alias
        {remote, _Node, _Name} -> collected(convoy_scope:collect_send(mixed, Dest, Msg));
        _ -> ok = send(Dest, Msg, #{})
    end.

%% @doc `send/2' to a pid of another node, `Node' (`convoy:send/2' read it);
%% inside `convoy:batch/1', collected.
-spec send_remote(node(), pid(), term()) -> ok.
send_remote(Node, Pid, Msg) ->
    case convoy_scope:collect_send(Node, Pid, Msg) of
        none -> convoy_send:send(Node, Pid, Msg);
        collected -> ok;
        full -> leave()
    end.

%% @doc See `convoy:send/3' (options already checked there).
-spec send(convoy:dest(), term(), convoy:send_options()) -> ok | {error, overload}.
send(Dest, Msg, Opts) ->
    case resolve(Dest) of
        local ->
            erlang:send(Dest, Msg),
            ok;
        {local, _Name} ->
            %% as `!': badarg for an unregistered Name, nothing for {Name, node()}
            erlang:send(Dest, Msg),
            ok;
        {remote, Node, To} ->
            convoy_send:remote(with_opts(persistent_term:get(?RUNTIME_KEY, undefined), Opts), Node,
                               To, Msg);
        error ->
            erlang:error(badarg, [Dest, Msg])
    end.

%% @doc See `convoy:send_many/1'.
-spec send_many([{convoy:dest(), term()}]) -> ok.
send_many(Sends) ->
    {Local, Remote} = resolve_many(Sends, Sends, [], #{}, []),
    lists:foreach(fun({Pid, Msg}) -> erlang:send(Pid, Msg) end, Local),
    many(persistent_term:get(?RUNTIME_KEY, undefined), Remote).

%% Everything is checked before anything is sent (as `multicast/2'): local
%% names are looked up once, remote messages are grouped by node in list order
%% (`Nodes' the nodes in the order first met), sends to pids of one node in a
%% row gathered before the map is touched (`group/4').
resolve_many([], _All, Local, Remote, Nodes) ->
    {lists:reverse(Local),
     [{Node, lists:reverse(maps:get(Node, Remote))} || Node <- lists:reverse(Nodes)]};
resolve_many([{Dest, Msg} | Rest], All, Local, Remote, Nodes) ->
    case resolve(Dest) of
        local ->
            resolve_many(Rest, All, [{Dest, Msg} | Local], Remote, Nodes);
        {local, Name} ->
            case whereis(Name) of
                undefined when is_atom(Dest) -> erlang:error(badarg, [All]);
                undefined -> resolve_many(Rest, All, Local, Remote, Nodes);
                Pid -> resolve_many(Rest, All, [{Pid, Msg} | Local], Remote, Nodes)
            end;
        {remote, Node, To} ->
            case Remote of
                #{Node := Tos} ->
                    remote_sends(Node, Rest, [{To, Msg} | Tos], All, Local, Remote, Nodes);
                _ ->
                    remote_sends(Node, Rest, [{To, Msg}], All, Local, Remote, [Node | Nodes])
            end;
        error ->
            erlang:error(badarg, [All])
    end;
resolve_many(_Improper, All, _Local, _Remote, _Nodes) ->
    erlang:error(badarg, [All]).

%% The sends to pids of Node that follow go on Tos (newest first), then Tos in
%% the map.
remote_sends(Node, [{D, Msg} | Rest], Tos, All, Local, Remote, Nodes)
  when is_pid(D), node(D) =:= Node ->
    remote_sends(Node, Rest, [{D, Msg} | Tos], All, Local, Remote, Nodes);
remote_sends(Node, Rest, Tos, All, Local, Remote, Nodes) ->
    resolve_many(Rest, All, Local, Remote#{Node => Tos}, Nodes).

%% @doc Remote messages of `send_many/1', by node (`Remote', in list order). While convoy runs, a node's small
%% messages go to the sender's lane for the node together: one admission, room
%% taken for all of them at once, and one hand-over. A node for which that
%% is not the plain case (a large message among them, no room for all of them
%% at once, a message in pieces not yet confirmed) gets its messages one by one,
%% as `send/2' sends them, after the hand-over: messages to one node keep their
%% order, and nothing orders messages to different nodes.
-spec many(#runtime{} | undefined, [{node(), [{term(), term()}]}]) -> ok.
many(RT = #runtime{stopping = false, large_threshold = T}, Remote) ->
    {Together, OneByOne} = lists:foldr(
                             fun({Node, Tos} = Group, {Tg, One}) ->
                                     case is_pieces(convoy_sender:marker(Node)) of
                                         false ->
                                             case entries(Node, Tos, T, [], 0) of
                                                 {Entries, Bytes} ->
                                                     {[{Node, Entries, Bytes, Group} | Tg], One};
                                                 large ->
                                                     {Tg, [Group | One]}
                                             end;
                                         true ->
                                             {Tg, [Group | One]}
                                     end
                             end, {[], []}, Remote),
    case convoy_send:together(RT, Together) of
        {again, Groups, Left} ->
            %% a lane was closed: under the runtime republished meanwhile
            many(persistent_term:get(?RUNTIME_KEY, undefined), Groups),
            one_by_one(RT, Left ++ OneByOne);
        Left ->
            one_by_one(RT, Left ++ OneByOne)
    end;
many(RT, Remote) ->
    one_by_one(RT, Remote).

is_pieces({pieces, _}) -> true;
is_pieces(_) -> false.

%% The lane's sends for Node's messages, newest first, with their bytes; `large'
%% if one of them is.
entries(_Node, [], _T, Entries, Bytes) ->
    {Entries, Bytes};
entries(Node, [{To, Msg} | Rest], T, Entries, Bytes) ->
    case convoy_size:measure(Msg, T) of
        {small, B} -> entries(Node, Rest, T, [{?TAG_SEND, Node, To, Msg, B} | Entries],
                              Bytes + B);
        {large, _} -> large
    end.

one_by_one(RT, Remote) ->
    lists:foreach(fun({Node, Tos}) ->
                          lists:foreach(fun({To, Msg}) ->
                                                _ = convoy_send:remote(RT, Node, To, Msg)
                                        end, Tos)
                  end, Remote).

%% @doc See `convoy:multicast/2'.
-spec multicast([convoy:dest()], term()) -> ok.
multicast(Dests, Msg) when is_list(Dests) ->
    {Local, Remote} = group(Dests, Msg, [], #{}),
    lists:foreach(fun(D) -> erlang:send(D, Msg) end, Local),
    case map_size(Remote) =:= 0 orelse convoy_scope:collect({multicast, Remote, Msg}) of
        true -> ok;
        none -> multicast_remote(Remote, Msg);
        Collected -> collected(Collected) % inside convoy:batch/1
    end;
multicast(Dests, Msg) ->
    erlang:error(badarg, [Dests, Msg]).

%% @doc See `convoy:multicast/3' (options already checked there): `{error,
%% overload}' when a node's entry was refused (the other nodes' are sent).
-spec multicast([convoy:dest()], term(), convoy:send_options()) -> ok | {error, overload}.
multicast(Dests, Msg, Opts) when is_list(Dests) ->
    {Local, Remote} = group(Dests, Msg, [], #{}),
    lists:foreach(fun(D) -> erlang:send(D, Msg) end, Local),
    entries(with_opts(persistent_term:get(?RUNTIME_KEY, undefined), Opts), Remote, Msg);
multicast(Dests, Msg, Opts) ->
    erlang:error(badarg, [Dests, Msg, Opts]).

%% @doc `multicast/2''s remote part: its (checked) destinations by node.
-spec multicast_remote(#{node() => [convoy:dest()]}, term()) -> ok.
multicast_remote(Remote, Msg) ->
    ok = entries(persistent_term:get(?RUNTIME_KEY, undefined), Remote, Msg).

%% Each node's destinations as entries a peer's inbox accepts (convoy_wire's cost
%% limit): `ok', or `{error, overload}' if any was refused.
%% The message is measured once for all of them.
entries(RT, Remote, Msg) ->
    Size = convoy_send:entry_size(RT, Msg),
    PerEntry = convoy_wire:per_entry(Msg),
    maps:fold(fun(Node, Tos, Acc) ->
                      lists:foldl(fun({Ts, _}, A) ->
                                          case convoy_send:entry(RT, Node, Ts, Msg, Size) of
                                              ok -> A;
                                              {error, overload} = E -> E
                                          end
                                  end, Acc, convoy_wire:multicast_entries(Tos, Msg, PerEntry))
              end, ok, Remote).

%% @doc One multicast entry to `Node': `Tos' (destinations on `Node', within the
%% inbox's cost limit, see `convoy_wire:multicast_entries/2') or a `pg' group
%% (`{'$convoy_publish', Scope, Group}', for a peer that reads publish entries).
%% It takes the path of `multicast/2''s entries, so it keeps its place among the
%% caller's other messages to `Node'.
-spec multicast_entry(node(), [convoy:dest()] | {?TAG_PUBLISH, atom(), term()}, term()) ->
          ok.
multicast_entry(Node, Tos, Msg) ->
    convoy_send:entry(persistent_term:get(?RUNTIME_KEY, undefined), Node, Tos, Msg).

%%--------------------------------------------------------------------
%% convoy:batch/1

%% @doc See `convoy:batch/1'.
-spec batch(fun(() -> T)) -> T.
batch(Fun) when is_function(Fun, 0) ->
    Outer = convoy_scope:is_open(),
    case Outer of
        false -> convoy_scope:open(max_batch());
        true -> leave() % what the outer scope collected goes first
    end,
    try Fun() of
        Result ->
            leave(),
            Result
    catch
        Class:Reason:Stack ->
            leave(),
            erlang:raise(Class, Reason, Stack)
    after
        Outer orelse convoy_scope:close()
    end;
batch(Fun) ->
    erlang:error(badarg, [Fun]).

%% @doc Send what the caller's `batch/1' scope collected, if it is in one.
-spec leave() -> ok.
leave() ->
    case convoy_scope:take() of
        {none, []} -> ok;
        {mixed, Items} -> send_segments(segments(Items, [], []));
        {Node, Sends} -> send_run(Node, lists:reverse(Sends))
    end.

%% A scope holding max_batch calls sends them.
collected(collected) -> ok;
collected(full) -> leave().

max_batch() ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        #runtime{max_batch = MB} -> MB;
        undefined -> 1000
    end.

%% The collected calls (newest first) as segments, oldest first: runs of sends
%% (oldest first, each send as it was collected) and multicasts. One walk, no
%% copy of the sends.
segments([{multicast, _, _} = M | Rest], Run, Segments) ->
    segments(Rest, [], [M | run(Run, Segments)]);
segments([Send | Rest], Run, Segments) ->
    segments(Rest, [Send | Run], Segments);
segments([], Run, Segments) ->
    run(Run, Segments).

run([], Segments) -> Segments;
run(Run, Segments) -> [{sends, Run} | Segments].

%% A run of collected sends, oldest first: one alone by send/2's own path; sends
%% to pids of one node `Node' as that node's messages as they are (checked when
%% collected); others (`mixed') as one send_many/1.
send_run(_Node, [{Dest, Msg}]) ->
    ok = send(Dest, Msg, #{});
send_run(mixed, Run) ->
    send_many(Run);
send_run(Node, Run) ->
    many(persistent_term:get(?RUNTIME_KEY, undefined), [{Node, Run}]).

%% Each run of sends as `send_run/2' sends it, a multicast in its place.
send_segments([{sends, Run} | Rest]) ->
    send_run(mixed, Run),
    send_segments(Rest);
send_segments([{multicast, Remote, Msg} | Rest]) ->
    multicast_remote(Remote, Msg),
    send_segments(Rest);
send_segments([]) ->
    ok.

%% Everything is checked before anything is sent, so a bad destination raises
%% badarg with nothing sent. Remote pids of one node in a row (as a list of a
%% group's members usually comes) are gathered before the map is touched: a map
%% update per pid cost about four times the whole walk. A pid's node list is
%% matched in the map, not looked up by a call (pids of nodes taking turns).
group([], _Msg, Local, Remote) ->
    {lists:reverse(Local), maps:map(fun(_, Tos) -> lists:reverse(Tos) end, Remote)};
group([D | Rest], Msg, Local, Remote) when is_pid(D), node(D) =/= node() ->
    Node = node(D),
    case Remote of
        #{Node := Tos} -> remote_pids(Node, Rest, [D | Tos], Msg, Local, Remote);
        #{} -> remote_pids(Node, Rest, [D], Msg, Local, Remote)
    end;
group([D | Rest], Msg, Local, Remote) ->
    case resolve(D) of
        local ->
            group(Rest, Msg, [D | Local], Remote);
        {local, Name} ->
            %% as `!' would do: badarg for an unregistered Name, while a message
            %% to an unregistered {Name, node()} is dropped
            case whereis(Name) of
                undefined when is_atom(D) -> erlang:error(badarg, [[D | Rest], Msg]);
                undefined -> group(Rest, Msg, Local, Remote);
                Pid -> group(Rest, Msg, [Pid | Local], Remote)
            end;
        {remote, Node, To} ->
            remote_run(Node, To, Rest, Msg, Local, Remote);
        error ->
            erlang:error(badarg, [[D | Rest], Msg])
    end.

%% To on Node, and the pids of Node right after it, added to Node's list at once.
remote_run(Node, To, Rest, Msg, Local, Remote) ->
    remote_pids(Node, Rest, [To | maps:get(Node, Remote, [])], Msg, Local, Remote).

%% The pids of Node that follow go on Tos (newest first), then Tos in the map.
remote_pids(Node, [D | Rest], Tos, Msg, Local, Remote) when is_pid(D), node(D) =:= Node ->
    remote_pids(Node, Rest, [D | Tos], Msg, Local, Remote);
remote_pids(Node, Rest, Tos, Msg, Local, Remote) ->
    group(Rest, Msg, Local, Remote#{Node => Tos}).

%% send/3 options apply to this call: a refused message is reported, not dropped.
with_opts(RT, Opts) when map_size(Opts) =:= 0; RT =:= undefined ->
    RT;
with_opts(RT = #runtime{overload = O, block_timeout = T}, Opts) ->
    RT#runtime{overload = maps:get(overload, Opts, O),
               block_timeout = maps:get(block_timeout, Opts, T),
               refuse = error}.

resolve(Pid) when is_pid(Pid) -> local_or_remote(node(Pid), Pid);
resolve(Ref) when is_reference(Ref) -> local_or_remote(node(Ref), Ref);
resolve(Name) when is_atom(Name) -> {local, Name};
resolve({Name, Node}) when is_atom(Name), is_atom(Node) ->
    case Node =:= node() of
        true -> {local, Name};
        false -> {remote, Node, Name}
    end;
resolve(_) -> error.

local_or_remote(Node, Dest) ->
    case Node =:= node() of
        true -> local;
        false -> {remote, Node, Dest}
    end.

